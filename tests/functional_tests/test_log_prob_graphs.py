"""Log-prob decode steps replay their own sampling variant's log-prob twin (graph_plan.py), not
the FULL variant, on the CPU with emulated graphs (a replay runs the padded step eagerly with
the graph's flags): tokens, log-probs and top-n equal the eager engine's (the torch reference,
``sampling.log_probs_of``) to float32 rounding (padding changes the GEMM shapes), greedy,
sampled, top-p and top-k filtered, serial and launch-ahead; the replay counters show which graphs served
the steps."""
import random

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
from tests.helpers.engine_harness import Arrival, count_replays_by_variant, run_arrivals

CFG = dict(block_size_tokens=4, num_kv_blocks=256, max_requests=6, max_tokens=24, max_sequence_length=96)
N = 6
KINDS = {  # the sampling of every request of a run, and the twin its decode steps replay
    "greedy": (SamplingParams(top_k=1, num_tokens_to_generate=N, return_log_probs=True, top_n_logprobs=5),
               "greedy+log_probs"),
    "temperature": (SamplingParams(temperature=0.9, num_tokens_to_generate=N, return_log_probs=True),
                    "temperature+log_probs"),
    "top_p": (SamplingParams(temperature=0.8, top_p=0.9, num_tokens_to_generate=N, top_n_logprobs=20),
              "nucleus+log_probs"),
    "top_k": (SamplingParams(temperature=0.8, top_k=50, top_p=0.9, num_tokens_to_generate=N, return_log_probs=True),
              "filtered+log_probs"),
}


def _run(params: SamplingParams, graphs: bool, async_scheduling: bool):
    rng = random.Random(5)
    arrivals = [Arrival(rng.randrange(0, 4), [rng.randrange(1, 1000) for _ in range(rng.randint(3, 20))],
                        SamplingParams(**{**vars(params), "seed": i})) for i in range(5)]
    llm = LLM(None, inference_config=InferenceConfig(**CFG, async_scheduling=async_scheduling))
    replays = None
    if graphs:
        llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing(), mixed=True, emulate=True)
        llm.runner.graphs.warmup()
        replays = count_replays_by_variant(llm.runner.graphs)
    outs = run_arrivals(llm, arrivals)
    return [(o.generated_tokens, o.generated_log_probs, o.generated_top_n_logprobs) for _, o in sorted(outs.items())], \
        replays, llm


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("kind", list(KINDS))
def test_log_prob_decode_steps_replay_their_twin_with_the_eager_values(kind, async_scheduling):
    params, twin = KINDS[kind]
    ref, _, _ = _run(params, graphs=False, async_scheduling=async_scheduling)
    got, replays, llm = _run(params, graphs=True, async_scheduling=async_scheduling)
    for (tok, lp, top), (rtok, rlp, rtop) in zip(got, ref, strict=True):
        assert tok == rtok and len(tok) == N
        assert (lp is None) == (rlp is None) == (not params.return_log_probs)
        if lp is not None:
            assert lp == pytest.approx(rlp, rel=1e-5, abs=1e-5)
        if params.top_n_logprobs:
            assert len(top) == len(rtop) == N
            for a, b in zip(top, rtop):
                assert list(a) == list(b) and len(a) == params.top_n_logprobs
                assert list(a.values()) == pytest.approx(list(b.values()), rel=1e-5, abs=1e-5)
    st = llm.engine.stats
    # decode steps replay the twin, never FULL; mixed steps (prefill chunks) the FULL mixed graphs
    assert replays[twin] == st.graph_replays - st.mixed_graph_replays > 0, replays
    assert replays["full"] == st.mixed_graph_replays > 0 and sum(replays.values()) == st.graph_replays, replays
    assert st.graph_captures_after_warmup == 0
