"""The n samples of one prompt prefill it once (``InferenceConfig.share_prompt_prefill``): the
counters show the others waited and took the prompt's complete blocks, prefill tokens drop by
exactly those, each sample equals the same request run alone, and launch-ahead == serial with
groups arriving while others decode, under memory pressure and with prefix caching."""
import pytest

from megatron_async import SamplingParams
from tests.helpers.engine_harness import Arrival, make_llm, random_prompts, run_arrivals, tokens_of

BS = 4  # make_llm's block size


def sampled(seed: int, n: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=40, seed=seed, num_tokens_to_generate=n)


def shared_blocks_tokens(prompt_len: int) -> int:
    return (prompt_len - 1) // BS * BS


@pytest.mark.parametrize("caching", [False, True])
def test_group_prefills_once_and_each_sample_equals_its_single_request(qwen3_ckpt, caching):
    prompt = random_prompts(1, 31, 31, 256, seed=7)[0]
    params = [sampled(20 + i) for i in range(5)]
    alone = [make_llm(qwen3_ckpt, enable_prefix_caching=caching).generate([prompt], p)[0].generated_tokens
             for p in params]
    runs = {}
    for mode in (False, True):
        llm = make_llm(qwen3_ckpt, async_scheduling=mode, enable_prefix_caching=caching)
        outs = run_arrivals(llm, [Arrival(0, prompt, p) for p in params])
        st = llm.engine.stats
        saved = shared_blocks_tokens(len(prompt))
        assert st.prompt_shares == 4 and st.shared_prompt_tokens == 4 * saved, st.as_dict()
        assert st.prefill_tokens == 5 * len(prompt) - 4 * saved, st.as_dict()
        runs[mode] = [outs[i].generated_tokens for i in range(5)]
        if mode:
            assert st.overlapped_decode_steps > 0
    assert runs[False] == runs[True] == alone
    assert len({tuple(t) for t in alone}) > 1  # the samples really differ


def test_sharing_off_prefills_every_copy(qwen3_ckpt):
    prompt = random_prompts(1, 20, 20, 256, seed=8)[0]
    params = [sampled(30 + i) for i in range(3)]
    got = {}
    for share in (False, True):
        llm = make_llm(qwen3_ckpt, share_prompt_prefill=share)
        got[share] = [o.generated_tokens for o in llm.generate([prompt] * 3, params)]
        st = llm.engine.stats
        assert st.prefill_tokens == (3 * 20 if not share else 20 + 2 * (20 - shared_blocks_tokens(20)))
        assert (st.prompt_shares, st.prefix_hit_tokens > 0) == ((0, False) if not share else (2, True))
    assert got[False] == got[True]


@pytest.mark.parametrize("pressure", [False, True])
def test_groups_arriving_over_time_async_equals_serial(qwen3_ckpt, pressure):
    """Groups of 1-4 copies of random prompts (greedy and seeded), staggered, mixed with unique
    prompts; with a small pool requests pause and are evicted (recomputes never wait)."""
    prompts = random_prompts(6, 6, 40, 256, seed=9)
    arrivals = []
    for g, p in enumerate(prompts):
        for i in range(1 + g % 4):
            sp = SamplingParams(top_k=1, num_tokens_to_generate=12) if g % 3 == 0 else sampled(100 * g + i, 12)
            arrivals.append(Arrival(2 * g + (i == 3), p, sp))
    cfg = dict(num_kv_blocks=40, max_tokens=32) if pressure else {}
    results = {}
    for mode in (False, True):
        llm = make_llm(qwen3_ckpt, async_scheduling=mode, **cfg)
        outs = run_arrivals(llm, arrivals)
        results[mode] = (tokens_of(outs), llm.engine.stats)
    (serial, s), (asyn, a) = results[False], results[True]
    assert serial == asyn
    assert a.prompt_shares > 3 and a.shared_prompt_tokens > 0, a.as_dict()
    assert (s.prompt_shares, s.shared_prompt_tokens, s.prefill_tokens) == (a.prompt_shares, a.shared_prompt_tokens,
                                                                          a.prefill_tokens)
    if pressure:
        assert a.paused + a.evicted > 0, a.as_dict()
    assert a.overlapped_decode_steps > 0.5 * a.decode_steps, a.as_dict()
    alone = make_llm(qwen3_ckpt)  # every request alone, one at a time
    for i, arr in enumerate(arrivals):
        assert alone.generate([arr.prompt], arr.params)[0].generated_tokens == serial[i], i


def test_prompt_scoring_request_never_waits(qwen3_ckpt):
    """A request scoring its prompt takes no hit (its log-probs would have a hole): it prefills
    its prompt itself, beside a copy that does wait."""
    llm = make_llm(qwen3_ckpt)
    prompt = random_prompts(1, 18, 18, 256, seed=10)[0]
    scoring = SamplingParams(top_k=1, num_tokens_to_generate=4, return_prompt_log_probs=True)
    outs = llm.generate([prompt] * 3, [sampled(1, 4), scoring, sampled(2, 4)])
    assert len(outs[1].prompt_log_probs) == len(prompt) - 1
    st = llm.engine.stats
    assert st.prompt_shares == 1 and st.prefill_tokens == 2 * 18 + 2, st.as_dict()
