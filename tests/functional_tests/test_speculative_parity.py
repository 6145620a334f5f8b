"""Speculative decoding == plain decoding: tokens, finish reasons, log-probs; serial and
launch-ahead; greedy and seeded sampling; n-gram and oracle drafters. Each case asserts that
drafts really were accepted and rejected (EngineStats)."""
from megatron_async import SamplingParams
from tests.helpers.engine_harness import Arrival, random_prompts
from tests.helpers.spec_harness import assert_partial_acceptance, run_plain_and_spec

GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=16, return_log_probs=True)
SAMPLED = [
    SamplingParams(temperature=0.8, top_k=20, seed=11, num_tokens_to_generate=16, return_log_probs=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=12, num_tokens_to_generate=16, return_log_probs=True),
    SamplingParams(temperature=1.2, min_p=0.05, top_k=40, seed=13, num_tokens_to_generate=16, return_log_probs=True),
    SamplingParams(temperature=0.7, num_tokens_to_generate=16, return_log_probs=True),  # engine-assigned seed
]


def test_oracle_greedy_partial_acceptance(qwen3_ckpt):
    arr = [Arrival(0, p, GREEDY) for p in random_prompts(6, 3, 20, 256, seed=21)]
    for _, _, st in run_plain_and_spec(qwen3_ckpt, arr, k=3, drafter_rate=0.3).values():
        assert_partial_acceptance(st)


def test_oracle_seeded_sampling_staggered(qwen3_ckpt):
    prompts = random_prompts(8, 3, 20, 256, seed=22)
    arr = [Arrival(2 * i, p, SAMPLED[i % 4]) for i, p in enumerate(prompts)]
    for _, _, st in run_plain_and_spec(qwen3_ckpt, arr, k=2, drafter_rate=0.4).values():
        assert_partial_acceptance(st)


def test_ngram_repetitive_prompts(qwen3_ckpt):
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3, [7] * 12]
    arr = [Arrival(0, p, GREEDY) for p in prompts]
    for _, _, st in run_plain_and_spec(qwen3_ckpt, arr, k=3, drafter_rate=None, method="ngram").values():
        assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens > 0, st.as_dict()


def test_full_and_zero_acceptance_step_counts(qwen3_ckpt):
    """All drafts right: a request of 16 tokens needs ceil(16 / (k + 1)) decode rows; all wrong:
    one token per step, as plain decoding."""
    arr = [Arrival(0, p, GREEDY) for p in random_prompts(3, 4, 12, 256, seed=23)]
    full = run_plain_and_spec(qwen3_ckpt, arr, k=3, drafter_rate=0.0, async_modes=(False,))[False][2]
    assert full.spec_accepted_tokens == full.spec_draft_tokens > 0
    assert full.decode_steps == 4, full.as_dict()
    none = run_plain_and_spec(qwen3_ckpt, arr, k=3, drafter_rate=1.0, async_modes=(False,))[False][2]
    assert none.spec_accepted_tokens == 0 < none.spec_draft_tokens
    assert none.decode_steps == 15, none.as_dict()


def test_refusals(qwen3_ckpt):
    import pytest

    from megatron_async.inference.speculative.oracle import OracleDrafter
    from tests.helpers.engine_harness import make_llm

    with pytest.raises(ValueError, match="MTP heads"):
        make_llm(qwen3_ckpt, num_speculative_tokens=2)  # default method "mtp", no heads
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_llm(qwen3_ckpt, OracleDrafter({}, 0.5, 256, 8))
