"""Collective graph captures without their eager runs (capture_agreement.py), on the CPU over two
gloo ranks with the tiny MoE model and emulated graphs (tests/helpers/emulated_graphs.py: a
capture without an eager run executes nothing, one with it runs the step's real collectives).
The warm-up goes the engine's way (``engine.warmup()`` -> ``run_warmup`` with the ranks'
host-side agreement), its dry pass stood in for as complete on every rank.

Without failures every graph captures without an eager run. When rank 1's capture of one graph
fails, both ranks drop that graph, run its step eagerly together (the same MoE exchanges in the
same order on both: a rank retrying alone would wait in the exchange for ever, and the test's
deadline would fire) and capture it again; both end with the same graphs, and the tokens equal
one engine's."""
from __future__ import annotations

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.text_generation_controllers import warmup as warmup_module
from megatron_async.inference.text_generation_controllers.cuda_graphs import decode_key
from megatron_async.inference.text_generation_controllers.graph_plan import GraphKey, SamplingVariant
from megatron_async.inference.text_generation_controllers.kernel_prebuild import PrebuildReport
from tests.helpers.emulated_graphs import CollectiveLog, EmulatedGraphRunner
from tests.helpers.multiprocess import run_ranks

CONFIG = dict(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=16, max_sequence_length=64)
PROMPTS = [[3, 17, 42, 9, 100, 7], [5, 6, 7]]
PARAMS = [SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=6, ignore_eos=True, seed=3)]
FAILED = decode_key(1)  # the greedy one-row decode graph's tail: a single greedy request replays it
FORWARD = GraphKey(1, 1, True, SamplingVariant.GREEDY, logits_only=True)  # its forward (the exchanges)


def _generate(llm: LLM) -> list[list[int]]:
    return [llm.generate([p], s)[0].generated_tokens for p, s in zip(PROMPTS, PARAMS)]


def _dry_pass_done(runner, threads: int) -> PrebuildReport:
    return PrebuildReport(shapes=len(runner.graphs.plan.keys()))


def _worker(rank: int, world: int, fail_rank: int | None) -> dict:
    # the dry pass (CUDA captures, builds) stood in for: every rank built everything
    warmup_module.can_prebuild = lambda runner, threads: True
    warmup_module.wants_collective_prebuild = lambda runner: runner.graphs is not None
    warmup_module.prebuild_collective = _dry_pass_done
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe", expert_parallel_size=world)
    try:
        graphs = llm.runner.graphs = EmulatedGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=True,
                                                         collective=True)
        if rank == fail_rank:
            graphs.fail_next.add(FAILED)
        log = CollectiveLog(graphs)
        report = llm.engine.warmup()  # every rank at once, as LLM does on CUDA
        warmup_calls = list(log.calls)
        tokens = _generate(llm)
        return dict(report=report, keys=sorted(map(str, graphs.graphs)), plan=len(graphs.plan.keys()),
                    failed=graphs.failed, captures=graphs.captures, warmup_calls=warmup_calls, tokens=tokens,
                    replays=[mode for mode, _ in log.calls[len(warmup_calls):] if mode.startswith("graph")],
                    tails=graphs.replayed)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe")
    try:
        return _generate(llm)
    finally:
        llm.close()


def test_without_failures_every_collective_graph_captures_without_an_eager_run(expected):
    r0, r1 = run_ranks(_worker, 2, None, timeout_s=300)
    for r in (r0, r1):
        assert r["report"].graphs_captured == r["plan"] > 1
        # the first sampling tail and its forward run their steps (they make the shared pool), the rest do not
        assert r["report"].captures_without_eager_run == r["plan"] - 2
        assert r["report"].capture_retries == 0 and r["failed"] == []
        assert r["tokens"] == expected and r["replays"]
    assert r0["keys"] == r1["keys"]
    assert r0["warmup_calls"] == r1["warmup_calls"] and len(r0["warmup_calls"]) > 0  # the first graph's runs


def test_a_capture_failed_on_one_rank_is_captured_again_by_every_rank_after_an_eager_run(expected):
    r0, r1 = run_ranks(_worker, 2, 1, timeout_s=300)
    assert r1["failed"] == [FAILED] and r0["failed"] == []  # the situation happened, on rank 1 only
    for r in (r0, r1):
        assert r["report"].capture_retries == 1
        assert r["report"].graphs_captured == r["plan"]
        # the first tail and its forward ran, and the retried tail and its forward
        assert r["report"].captures_without_eager_run == r["plan"] - 4
        assert r["captures"].count(FAILED) == (1 if r is r1 else 2)  # rank 0 captured it, dropped it, again
        # rank 0's one-row greedy decode steps replayed it, rank 1 (idle) its padding rows in them
        assert r["tokens"] == expected and FAILED in r["tails"]
    assert r0["keys"] == r1["keys"]
    # the retry's eager runs (its forward's, dropped on every rank): the same exchanges on both
    # ranks, after the first graph's
    assert r0["warmup_calls"] == r1["warmup_calls"]
    assert any(mode == f"capture{FORWARD}" for mode, _ in r0["warmup_calls"])
