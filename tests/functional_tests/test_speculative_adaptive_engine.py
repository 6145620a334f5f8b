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


def test_steps_with_prefill_chunks_verify_nothing(qwen3_ckpt):
    """A batch arriving at once prefills over several steps while its first requests decode: the
    adaptive rule drafts in none of those steps (with drafts a step with prefill chunks has no
    graph and runs eager), then drafts once the batch only decodes; tokens equal plain."""
    arr = [Arrival(0, p, PARAMS[0]) for p in random_prompts(12, 12, 16, 256, seed=73)]
    cfg = dict(max_requests=12, max_tokens=48, async_scheduling=True)
    plain = run_arrivals(make_llm(qwen3_ckpt, **cfg), arr)
    llm = make_llm(qwen3_ckpt, oracle_for(plain, arr, 0.1), num_speculative_tokens=3, speculative_adaptive=True, **cfg)
    policy = llm.engine.scheduler.spec
    orig = policy.costs.observe  # verify steps cheap: drafting pays whenever it may
    policy.costs.observe = lambda rows, width, s, step: orig(rows, width, 1.0 + 0.05 * (width - 1), step)
    eng, kinds = llm.engine, []
    launch = eng.launch_plan

    def noted(plan, *a, **k):
        kinds.append((plan.is_all_decode, any(r.num_drafts for r in plan.rows), any(r.is_decode for r in plan.rows)))
        return launch(plan, *a, **k)

    eng.launch_plan = noted
    spec = run_arrivals(llm, arr)
    assert_same_outputs(plain, spec, log_prob_tol=1e-5)
    mixed_decoding = [k for k in kinds if not k[0] and k[2]]
    assert len(mixed_decoding) >= 2, kinds  # prefill steps that also decoded rows: the case under test
    assert not any(drafts for _, drafts, _ in mixed_decoding), kinds
    assert any(drafts for _, drafts, _ in kinds) and policy.off_rows["prefill"] > 0, (kinds, policy.off_rows)
