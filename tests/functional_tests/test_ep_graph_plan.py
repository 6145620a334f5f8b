"""Data-parallel engines with CUDA graphs, emulated on the CPU (gloo, 2 ranks): NCCL requires that
whether a collective is graph-captured be the same on every rank of the launch, and that ranks
replay graphs of one joint capture. So step by step, every rank must run its MoE exchanges in
the same mode (the same graph, or eager) at the same size, including a rank with nothing to do
(its dummy forward replays the agreed graph on padding rows) and a rank whose requests sample
(then every rank replays the sampled variant of the graph, the largest any rank needs). The emulated runner makes the real CudaGraphRunner decisions; each
rank's log of (mode, rows) per expert-parallel all-gather must be identical, and tokens must
equal one engine's. Workload: one rank idle for many steps, then staggered mixed arrivals. With
mixed graphs, a step whose largest launch holds more tokens than a decode batch replays the
16-token mixed graph on every rank (the prefill rank, a decode rank, an idle one)."""
from __future__ import annotations

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.text_generation_controllers.cuda_graphs import decode_key
from megatron_async.inference.text_generation_controllers.graph_plan import GraphKey, SamplingVariant
from tests.helpers.emulated_graphs import CollectiveLog, EmulatedGraphRunner
from tests.helpers.engine_harness import run_leader_arrivals
from tests.helpers.multiprocess import run_ranks

CONFIG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16, max_sequence_length=96)
LONG = ([3, 17, 42, 9, 100, 7], SamplingParams(top_k=1, num_tokens_to_generate=24, ignore_eos=True))
GREEDY = lambda n: SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True)  # noqa: E731
SAMPLED = lambda n, s: SamplingParams(  # noqa: E731
    temperature=0.9, top_p=0.8, num_tokens_to_generate=n, ignore_eos=True, seed=s)
# (arrival step, prompt, params): greedy and sampled mixed, a 3-row batch on one rank padded to 4
ARRIVALS = [(0, [5] * 11, GREEDY(12)), (1, [250, 1, 2], GREEDY(5)), (2, [60, 61, 62, 63], SAMPLED(4, 7)),
            (2, [8, 9], GREEDY(9)), (6, [11, 12, 13], GREEDY(3)), (9, [40] * 7, SAMPLED(5, 8)),
            (12, [7, 8, 9, 10], GREEDY(6))]


def workload(llm: LLM, rank: int, log: CollectiveLog | None) -> dict:
    result, marks = {}, []
    for mode in ("async", "serial"):
        llm.engine.async_scheduling = mode == "async"
        start = len(log.calls) if log else 0
        result[f"{mode}_idle"] = llm.generate([LONG[0]], LONG[1])[0].generated_tokens
        marks.append((f"{mode}_idle", start, len(log.calls) if log else 0))
        result[f"{mode}_staggered"] = run_leader_arrivals(llm, rank, ARRIVALS)
    result["marks"] = marks
    return result


def _worker(rank: int, world: int, mixed: bool) -> dict:
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe", expert_parallel_size=world)
    try:
        graphs = llm.runner.graphs = EmulatedGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=mixed,
                                                         collective=True)
        graphs.warmup()  # every rank at once, as LLM does on CUDA
        log = CollectiveLog(graphs)
        result = workload(llm, rank, log)
        st = llm.engine.stats
        result.update(calls=log.calls, captures=graphs.captures, dummy=st.dummy_steps, served=st.finished_requests,
                      replays=graphs.num_replays, padding_replays=graphs.num_padding_replays, tails=graphs.replayed)
        return result
    finally:
        llm.close()


@pytest.mark.parametrize("mixed", [False, True])
def test_every_rank_runs_the_same_graph_or_eager_collectives_step_by_step(mixed):
    expected = workload(LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe"), 0, None)
    r0, r1 = run_ranks(_worker, 2, mixed, timeout_s=300)
    # the 16-token mixed graph (FULL sampling) when mixed graphs are on; decode graphs of every
    # variant; each a sampling tail after its size's forward (every exchange is in the forward)
    greedy = SamplingVariant.GREEDY
    mixed_key = GraphKey(16, 5, False, SamplingVariant.FULL)
    mixed_forward = GraphKey(16, 5, False, greedy, logits_only=True)
    decode = [[GraphKey(b, b, True, greedy, logits_only=True)] + [decode_key(b, v) for v in SamplingVariant]
              for b in (4, 2, 1)]
    want = ([mixed_forward, mixed_key] if mixed else []) + [k for keys in decode for k in keys]
    assert r0["captures"] == r1["captures"] == want
    assert len(r0["calls"]) == len(r1["calls"]), "the ranks ran different numbers of MoE exchanges"
    for i, (a, b) in enumerate(zip(r0["calls"], r1["calls"])):
        assert a == b, f"MoE exchange #{i}: rank 0 ran {a}, rank 1 ran {b}"
    for mode in ("async", "serial"):
        assert r0[f"{mode}_idle"] == expected[f"{mode}_idle"]
        assert r0[f"{mode}_staggered"] == expected[f"{mode}_staggered"]
    # the situations happened: rank 1 was idle while rank 0 replayed graphs (so its dummy
    # forwards replayed them too), sampled steps replayed the sampled variant on both ranks
    # (a greedy or idle rank took its peer's variant), prefill steps ran eager, and both ranks served
    for name, start, end in r1["marks"]:
        idle_modes = {m for m, _ in r1["calls"][start:end]}
        assert any(m.startswith("graph") for m in idle_modes), f"{name}: rank 1's dummies never replayed"
    assert r1["dummy"] > 20 and r0["dummy"] > 0 and r1["padding_replays"] > 20
    assert r0["replays"] > 0 and r1["replays"] > 0
    mixed_replays = [(m, n) for m, n in r0["calls"] if m == f"graph{mixed_forward}"]
    if mixed:  # prefill steps replayed the mixed graph (its exchange padded to its 16 tokens) on both ranks
        assert mixed_replays and all(n == 16 for _, n in mixed_replays)
    else:  # prefill steps ran eager
        assert not mixed_replays and any(m == "eager" for m, _ in r0["calls"])
    # tails: the same sampling variant on both ranks, step by step
    assert r0["tails"] == r1["tails"]
    sampled = [k for k in r0["tails"] if k.variant != greedy and k != mixed_key]
    assert sampled and all(k.variant == SamplingVariant.NUCLEUS for k in sampled), sampled  # temperature + top-p
    assert r0["served"] > 0 and r1["served"] > 0
