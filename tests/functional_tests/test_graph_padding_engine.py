"""Graph padding on the CPU: the graph runner in emulation (no capture; a replay runs the
padded step eagerly) pads decode and mixed steps exactly as a CUDA replay does, so its tokens
and log-probs must equal the unpadded engine's on ragged batches with every sampling feature
(float32, CPU). Also: warm-up leaves the engine's state as it found it, and it covers every
key the run asks for (0 captures after warm-up)."""
import random

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
from tests.functional_tests.engine_harness import Arrival, run_arrivals

CFG = dict(block_size_tokens=4, num_kv_blocks=256, max_requests=6, max_tokens=24, max_sequence_length=96)
N = 8
PARAMS = [
    SamplingParams(top_k=1, num_tokens_to_generate=N),
    SamplingParams(temperature=0.9, seed=3, num_tokens_to_generate=N),
    SamplingParams(temperature=0.8, top_p=0.9, seed=4, num_tokens_to_generate=N, return_log_probs=True),
    SamplingParams(temperature=0.7, top_k=5, min_p=0.05, presence_penalty=0.5, seed=5, num_tokens_to_generate=N),
    SamplingParams(top_k=1, repetition_penalty=1.3, top_n_logprobs=3, num_tokens_to_generate=N),
    SamplingParams(top_k=1, top_n_logprobs=25, num_tokens_to_generate=N),  # beyond GRAPH_TOP_N: eager
]


def _arrivals(seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    return [Arrival(rng.randrange(0, 12), [rng.randrange(1, 1000) for _ in range(rng.randint(3, 40))],
                    PARAMS[i % len(PARAMS)]) for i in range(12)]


def _run(arrivals, graphs: bool, async_scheduling: bool, warmup: bool = True):
    llm = LLM(None, inference_config=InferenceConfig(**CFG, async_scheduling=async_scheduling))
    if graphs:
        llm.controller.graphs = CudaGraphRunner(llm.controller, llm.config, mixed=True, emulate=True)
    if warmup:
        llm.engine.warmup()
    outs = run_arrivals(llm, arrivals)
    return {i: (o.generated_tokens, o.generated_log_probs, o.generated_top_n_logprobs) for i, o in outs.items()}, llm


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_graph_steps_equal_eager_steps(async_scheduling):
    arrivals = _arrivals(seed=7)
    ref, _ = _run(arrivals, graphs=False, async_scheduling=async_scheduling, warmup=False)
    got, llm = _run(arrivals, graphs=True, async_scheduling=async_scheduling)
    assert set(got) == set(ref) == set(range(len(arrivals)))
    for i in ref:
        assert got[i][0] == ref[i][0], i
        if ref[i][1] is not None:
            assert got[i][1] == pytest.approx(ref[i][1], rel=1e-5, abs=1e-5)
        if ref[i][2] is not None:  # a row's top-n: the head of the graph's sorted top-20
            for a, b in zip(got[i][2], ref[i][2]):
                assert list(a) == list(b) and list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
    st, runner = llm.engine.stats, llm.controller.graphs
    assert st.mixed_graph_replays > 0 and st.graph_replays > st.mixed_graph_replays  # both kinds ran
    assert st.graph_replays < st.steps  # the top-n 25 request's steps ran eager
    assert st.graph_captures_after_warmup == 0 and st.warmup_graphs == len(runner.plan.keys())
    assert {k.variant for k in runner.graphs} == {"greedy", "temperature", "filtered", "full"}
    if async_scheduling:
        assert st.overlapped_decode_steps > 0


def test_warmup_leaves_the_engine_state_intact():
    arrivals = _arrivals(seed=11)
    ref, _ = _run(arrivals, graphs=False, async_scheduling=True, warmup=False)
    got, llm = _run(arrivals, graphs=False, async_scheduling=True, warmup=True)
    assert got == ref
    st = llm.engine.stats
    assert st.warmup_seconds > 0 and st.warmup_graphs == 0 and st.graph_replays == 0
    with pytest.raises(RuntimeError, match="idle"):
        llm.engine.add_request([1, 2, 3], PARAMS[0])
        llm.engine.step()  # a launch is in flight now (launch-ahead keeps one)
        llm.engine.step()
        llm.engine.warmup()


def test_lazy_captures_are_counted_without_warmup():
    got, llm = _run(_arrivals(seed=3)[:4], graphs=True, async_scheduling=True, warmup=False)
    st = llm.engine.stats
    assert st.graph_replays > 0 and st.graph_captures_after_warmup == len(llm.controller.graphs.graphs) > 0
