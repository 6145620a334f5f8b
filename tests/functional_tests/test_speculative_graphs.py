"""Speculative decoding with CUDA graphs (emulated on the CPU: a replay runs the padded step
eagerly, as cuda_graphs.py's ``emulate`` mode does): verify steps (rows with drafts) never
replay a graph, steps without drafts (speculation switched off for a large batch, prefill
chunks) replay padded decode and mixed graphs, and the tokens equal plain eager decoding's (after a
startup warm-up, which must leave the speculative state as it found it)."""
import pytest

from megatron_async import SamplingParams
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
from tests.functional_tests.engine_harness import Arrival, make_llm, random_prompts, run_arrivals
from tests.functional_tests.spec_harness import assert_same_outputs, oracle_for

CFG = dict(max_requests=6, max_tokens=32, speculative_max_batch_size=2)  # > 2 decode rows: no drafts
PARAMS = [
    SamplingParams(top_k=1, num_tokens_to_generate=14, return_log_probs=True),
    SamplingParams(temperature=0.8, top_k=20, seed=11, num_tokens_to_generate=14, return_log_probs=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=12, num_tokens_to_generate=14),
]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_verify_steps_run_eager_and_draft_free_steps_replay(qwen3_ckpt, async_scheduling):
    prompts = random_prompts(7, 3, 30, 256, seed=31)
    arrivals = [Arrival(3 * (i // 2), p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(prompts)]
    plain = run_arrivals(make_llm(qwen3_ckpt, async_scheduling=async_scheduling, **CFG), arrivals)
    llm = make_llm(qwen3_ckpt, oracle_for(plain, arrivals, 0.3), async_scheduling=async_scheduling,
                   num_speculative_tokens=2, speculative_min_acceptance=0.0, **CFG)
    runner = llm.controller.graphs = CudaGraphRunner(llm.controller, llm.config, mixed=True, emulate=True)
    llm.engine.warmup()  # the eager pass runs the speculative step body on padding too: state intact
    lookups = []
    lookup = runner.lookup

    def logged(shape, min_rows=0, min_variant=0):
        step = lookup(shape, min_rows, min_variant)
        lookups.append((shape.num_samples > shape.num_rows, step is not None, shape.is_decode_only))
        return step

    runner.lookup = logged
    assert_same_outputs(plain, run_arrivals(llm, arrivals))
    st = llm.engine.stats
    assert not any(drafts and replayed for drafts, replayed, _ in lookups), "a verify step replayed a graph"
    assert any(drafts for drafts, _, _ in lookups) and st.spec_verify_rows > 0 and st.spec_accepted_tokens > 0
    assert st.spec_off_rows["batch"] > 0
    assert any(replayed and decode for _, replayed, decode in lookups) and st.mixed_graph_replays > 0
    assert st.graph_captures_after_warmup == 0 and st.warmup_graphs == len(runner.plan.keys())
