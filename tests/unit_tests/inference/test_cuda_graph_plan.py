"""CudaGraphRunner's decisions for data-parallel engines (no GPU: graphs stand in as keys):
decode plans that fit a jointly captured graph replay it at the largest sampling variant any
rank needs, and a collective runner never captures alone: a missing graph is a clear error,
not a capture (or a hang)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_async import InferenceConfig, SamplingParams
from megatron_async.inference.contexts.dynamic_context import StepShape
from megatron_async.inference.engines.step_plan import RowPlan, StepPlan
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner, decode_key
from megatron_async.inference.text_generation_controllers.graph_plan import GraphKey, SamplingVariant


def runner(collective: bool) -> CudaGraphRunner:
    ctl = SimpleNamespace(model=SimpleNamespace(vocab_size=64))
    r = CudaGraphRunner(ctl, InferenceConfig(max_requests=8), mixed=True, collective=collective)
    if collective:
        # decode only (no mixed), every sampling variant
        assert r.plan.keys() == [decode_key(b, v) for b in (8, 4, 2, 1) for v in SamplingVariant]
    r.graphs = {k: SimpleNamespace(num_rows=k.num_rows, key=k) for k in r.plan.keys()}  # what warmup captures
    return r


def decode_plan(*params: SamplingParams) -> StepPlan:
    return StepPlan([RowPlan(SimpleNamespace(sampling_params=sp), start=5, num_tokens=1, samples=True)
                     for sp in params])


GREEDY = SamplingParams(top_k=1)


V = list(SamplingVariant)


@pytest.mark.parametrize("other,variant", [
    (GREEDY, 0), (SamplingParams(temperature=0.0, top_p=0.5), 0), (SamplingParams(temperature=0.8), 1),
    (SamplingParams(temperature=0.8, top_k=40), 2), (SamplingParams(temperature=0.8, min_p=0.1), 2),
    (SamplingParams(top_k=1, return_log_probs=True), 3), (SamplingParams(top_k=1, top_n_logprobs=2), 3),
    (SamplingParams(top_k=1, repetition_penalty=1.2), 3), (SamplingParams(top_k=1, min_tokens=3), 3),
    (SamplingParams(top_k=1, top_n_logprobs=21), None),  # beyond GRAPH_TOP_N: eager
])
def test_a_decode_plan_replays_its_covering_variant(other, variant):
    assert runner(True).replay_variant(decode_plan(GREEDY, other)) == variant


def test_prefill_too_large_and_uncaptured_plans_run_eager():
    r = runner(True)
    prefill = StepPlan([RowPlan(SimpleNamespace(sampling_params=GREEDY), start=0, num_tokens=4, samples=True)])
    assert r.replay_variant(prefill) is None
    assert r.replay_variant(decode_plan(*[GREEDY] * 9)) is None  # beyond the largest size (8)
    del r.graphs[decode_key(4)]
    assert r.replay_variant(decode_plan(GREEDY, GREEDY, GREEDY)) is None  # pads to 4: not captured on every rank


def test_ranks_replay_the_agreed_variant():
    """A greedy step on a rank whose peers sample replays their (larger) variant, at their size."""
    r = runner(True)
    assert r.lookup(shape(2), min_rows=3, min_variant=2).key == decode_key(4, SamplingVariant.FILTERED)
    assert r.lookup(shape(2, sampling=True), min_variant=0).key == decode_key(2, SamplingVariant.TEMPERATURE)
    replayed = []
    r.graphs[decode_key(4, SamplingVariant.FULL)].replay = lambda: replayed.append("full 4")
    assert r.replay_padding(3, 3) == 4 and replayed == ["full 4"]


def shape(rows: int, sampling: bool = False) -> StepShape:
    return StepShape(rows, rows, 1, 9, True, sampling, False, 0, False)


def test_lookup_pads_to_the_agreed_rows():
    r = runner(True)
    assert r.lookup(shape(1), min_rows=3).num_rows == 4
    assert r.lookup(shape(3), min_rows=0).num_rows == 4
    assert r.lookup(shape(5), min_rows=8).num_rows == 8


def test_a_collective_runner_never_captures_alone():
    r = runner(True)
    r._capture = lambda key: pytest.fail(f"captured {key} on one rank")
    del r.graphs[decode_key(2, SamplingVariant.TEMPERATURE)]
    with pytest.raises(RuntimeError, match="agreed to replay CUDA graphs.*no graph that every rank captured"):
        r.lookup(shape(2, sampling=True))
    with pytest.raises(RuntimeError, match="agreed to replay"):
        r.lookup(StepShape(6, 2, 5, 9, False, False, False, 0, False))  # a prefill step under an agreed replay
    with pytest.raises(RuntimeError, match="no greedy CUDA graph for a dummy step of 9 rows"):
        r.replay_padding(9)
    with pytest.raises(RuntimeError, match="no temperature CUDA graph for a dummy step of 2 rows"):
        r.replay_padding(2, 1)


def test_a_single_engine_runner_captures_lazily():
    r = runner(False)
    r._capture = lambda key: SimpleNamespace(num_rows=key.num_rows, key=key)
    assert r.lookup(shape(2, sampling=True)).key == GraphKey(2, 2, True, SamplingVariant.TEMPERATURE)
    prefill = StepShape(6, 2, 5, 9, False, False, False, 0, False)
    assert r.lookup(prefill).key == GraphKey(16, 9, False, SamplingVariant.GREEDY)  # a mixed graph
    r.plan.token_counts = []
    assert r.lookup(prefill) is None  # no mixed graphs: eager


def test_a_step_with_drafts_never_replays():
    """Speculative verify rows (more sampled positions than rows) run eager, decode or mixed."""
    r = runner(False)
    r._capture = lambda key: pytest.fail(f"captured {key} for a verify step")
    assert r.lookup(StepShape(4, 2, 2, 9, False, False, False, 0, False, num_samples=4)) is None
    assert r.lookup(StepShape(5, 3, 3, 9, False, True, False, 0, False, num_samples=5)) is None


def test_llm_close_destroys_graphs_before_the_process_group():
    """ncclCommDestroy waits for every graph that captured NCCL ops: close() must drop them first
    (the multi-GPU EP + graphs runs hung in close otherwise)."""
    from megatron_async import LLM

    llm = LLM(None, inference_config=InferenceConfig(max_requests=4, num_kv_blocks=16, max_sequence_length=64))
    order = []
    r = runner(True)
    r.release = lambda: (order.append("graphs released"), CudaGraphRunner.release(r))
    llm.controller.graphs = r
    left = lambda: order.append(f"process group destroyed, graphs left: {len(r.graphs)}")  # noqa: E731
    llm.parallel = SimpleNamespace(destroy=left)
    llm.close()
    assert order == ["graphs released", "process group destroyed, graphs left: 0"]
    assert llm.controller.graphs is None
