"""The adaptive speculative policy inside the engine (CPU, launch-ahead and serial): whatever it
decides from the step costs it measures, tokens, finish reasons and log-probs equal plain
decoding; it measured steps, ran plain ones by its rule ("cost") and verified drafts."""
import pytest

from megatron_async import SamplingParams
from tests.helpers.engine_harness import Arrival, make_llm, random_prompts, run_arrivals
from tests.helpers.spec_harness import assert_same_outputs, oracle_for

PARAMS = [SamplingParams(top_k=1, num_tokens_to_generate=40, return_log_probs=True),
          SamplingParams(temperature=0.9, top_k=20, seed=5, num_tokens_to_generate=33, ignore_eos=True)]
CFG = dict(max_requests=6, max_tokens=32)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_adaptive_policy_keeps_tokens_and_decides_by_cost(qwen3_ckpt, async_scheduling):
    arr = [Arrival(2 * i, p, PARAMS[i % 2]) for i, p in enumerate(random_prompts(6, 3, 14, 256, seed=71))]
    plain = run_arrivals(make_llm(qwen3_ckpt, async_scheduling=async_scheduling, **CFG), arr)
    llm = make_llm(qwen3_ckpt, oracle_for(plain, arr, 0.2), num_speculative_tokens=3, speculative_adaptive=True,
                   async_scheduling=async_scheduling, **CFG)
    policy = llm.engine.scheduler.spec
    assert policy.adaptive
    # verify steps cheap here, whatever the CPU measures: every width pays at 80 % acceptance
    orig = policy.costs.observe
    policy.costs.observe = lambda rows, width, s, step: orig(rows, width, 1.0 + 0.05 * (width - 1), step)
    spec = run_arrivals(llm, arr)
    assert_same_outputs(plain, spec, log_prob_tol=1e-5)
    st = llm.engine.stats
    assert st.spec_off_rows["cost"] > 0 and st.spec_verify_rows > 0 and policy.costs.cells, st.as_dict()
