"""TP ranks' warm-up after a dry pass (capture_agreement.py, ``warmup._left_on_any_rank``), on the
CPU over two gloo ranks with the tiny model and emulated graphs (tests/helpers/emulated_graphs.py:
a capture without an eager run executes nothing, one with it runs the step's real all-reduces).

Every eager step of a TP rank holds all-reduces that need the other rank. So when one rank's dry
pass leaves a shape to run eagerly, every rank runs it, and no rank captures without eager runs;
and when one rank's capture without an eager run fails, every rank drops that graph, runs its
step eagerly and captures it again. A rank doing either alone would pair its all-reduces with
the other rank's later ones (a hang or wrong sums: the test's deadline or the tokens catch it).
Both ranks log the same all-reduces, and the tokens equal one GPU's."""
from __future__ import annotations

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.text_generation_controllers import warmup as warmup_module
from megatron_async.inference.text_generation_controllers.cuda_graphs import decode_key
from megatron_async.inference.text_generation_controllers.kernel_prebuild import PrebuildReport
from tests.helpers.emulated_graphs import AllReduceLog, EmulatedGraphRunner
from tests.helpers.multiprocess import run_ranks

CONFIG = dict(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=16, max_sequence_length=64)
PROMPTS = [[3, 17, 42, 9, 100, 7], [5, 6, 7]]
PARAMS = [SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=6, ignore_eos=True, seed=3)]
FAILED = decode_key(1)  # the greedy one-row decode graph's sampling tail: its forward fails with it


def _generate(llm: LLM) -> list[list[int]]:
    return [llm.generate([p], s)[0].generated_tokens for p, s in zip(PROMPTS, PARAMS)]


def _worker(rank: int, world: int, case: str) -> dict:
    left_rank = 1 if case == "left" else None

    def dry_pass(runner, shapes, threads, **kw):  # the dry pass (CUDA captures, builds) stood in for
        return PrebuildReport(shapes=len(shapes), left=shapes[-1:] if rank == left_rank else [])

    warmup_module.can_prebuild = lambda runner, threads: True
    warmup_module.prebuild_listed = dry_pass
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny", tensor_parallel_size=world)
    try:
        graphs = llm.runner.graphs = EmulatedGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=True)
        if case == "fail" and rank == 1:
            graphs.fail_next.add(graphs.forward_key(FAILED))
        log = AllReduceLog(graphs)
        report = llm.engine.warmup()  # every rank at once, as LLM does on CUDA
        return dict(report=report, keys=sorted(map(str, graphs.graphs)), failed=graphs.failed,
                    warmup_calls=list(log.calls), tokens=_generate(llm))
    finally:
        llm.close()


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny")
    try:
        return _generate(llm)
    finally:
        llm.close()


def test_a_shape_left_by_one_ranks_dry_pass_runs_eagerly_on_every_rank(expected):
    r0, r1 = run_ranks(_worker, 2, "left", timeout_s=300)
    for r in (r0, r1):
        assert r["report"].eager_steps == 1  # rank 1's left shape, on rank 0 too
        # rank 1's pass was not whole: no rank captures without eager runs
        assert r["report"].captures_without_eager_run == 0 and r["report"].graphs_captured > 1
        assert r["tokens"] == expected
    assert r0["warmup_calls"] == r1["warmup_calls"] and r0["warmup_calls"][0][0] == "eager"
    assert r0["keys"] == r1["keys"]


def test_a_capture_failed_on_one_tp_rank_is_captured_again_by_every_rank(expected):
    r0, r1 = run_ranks(_worker, 2, "fail", timeout_s=300)
    forward = f"capture{r0['failed'] or r1['failed'][0]}"
    assert r1["failed"] and r0["failed"] == []  # the situation happened, on rank 1 only
    for r in (r0, r1):
        assert r["report"].eager_steps == 0 and r["report"].capture_retries == 1
        # all but the first tail and its forward (they make the pool) and the retried tail and forward
        assert r["report"].captures_without_eager_run == r["report"].graphs_captured - 4
        assert r["tokens"] == expected
    # the first graph's eager runs and the retry's: the same all-reduces on both ranks
    assert r0["warmup_calls"] == r1["warmup_calls"]
    assert any(mode == forward for mode, _ in r0["warmup_calls"])
    assert r0["keys"] == r1["keys"]
