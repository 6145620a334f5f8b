"""Hybrid models through the engine: HF parity under memory pressure, async == serial, and
Mamba prefix caching (hits, LRU eviction, invalidation on KV eviction, fully matched prompts)."""
import pytest

from megatron_async import SamplingParams
from tests.helpers.engine_harness import Arrival, make_llm, random_prompts, run_arrivals, tokens_of
from tests.helpers.hf_hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_checkpoint
from tests.helpers.hf_models import hf_greedy, load_hf_reference

NEW = 8
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True)  # HF reference ignores EOS


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def hybrid(request, tmp_path_factory):
    path = make_tiny_hybrid_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    ref = load_hf_reference(path)
    vocab = ref.config.vocab_size
    return path, ref, vocab


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hybrid_matches_hf_with_chunks_pauses_evictions(hybrid, async_scheduling):
    path, ref, vocab = hybrid
    prompts = random_prompts(6, 2, 30, vocab, seed=1)
    expected = [hf_greedy(ref, p, NEW) for p in prompts]
    llm = make_llm(path, async_scheduling=async_scheduling, max_tokens=16, num_kv_blocks=30)
    outs = llm.generate(prompts, GREEDY)
    assert [o.generated_tokens for o in outs] == expected
    st = llm.engine.stats
    assert st.paused > 0 and st.evicted > 0 and st.prefill_steps > 2, st.as_dict()
    if async_scheduling:
        assert st.overlap_ratio >= 0.9


def test_hybrid_async_equals_serial_event_matrix(hybrid):
    path, _, vocab = hybrid
    sampled = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=4, num_tokens_to_generate=10)
    prompts = random_prompts(8, 3, 25, vocab, seed=2)
    probe = make_llm(path).generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=12))
    seen = [t for o in probe for t in o.generated_tokens[2:]]
    eos = max(set(seen), key=seen.count)  # a frequent token: greedy rows stop at scattered steps
    arr = [Arrival(2 * i, p, sampled if i % 2 else SamplingParams(top_k=1, num_tokens_to_generate=3 + 2 * i, termination_id=eos))
           for i, p in enumerate(prompts)]
    res = {}
    for mode in (False, True):
        llm = make_llm(path, async_scheduling=mode, num_kv_blocks=20, max_tokens=16)
        res[mode] = (tokens_of(run_arrivals(llm, arr)), llm.engine.stats)
    assert res[True][0] == res[False][0]
    a = res[True][1]
    assert a.overlapped_steps > 0.8 * a.steps and a.discarded_rows > 0, a.as_dict()
    assert a.paused > 0


def _prefix_llm(path, caching, mamba_gb=1e-3, **cfg):
    return make_llm(path, enable_prefix_caching=caching, prefix_caching_mamba_gb=mamba_gb, max_requests=2, **cfg)


def test_mamba_prefix_caching_same_tokens_and_skips(hybrid):
    path, _, vocab = hybrid
    shared = random_prompts(1, 22, 22, vocab, seed=3)[0]
    prompts = [shared + t for t in random_prompts(6, 1, 6, vocab, seed=4)]
    arr = [Arrival(4 * i, p, GREEDY) for i, p in enumerate(prompts)]
    off = run_arrivals(_prefix_llm(path, False), arr)
    for mode in (False, True):
        llm = _prefix_llm(path, True, async_scheduling=mode)
        on = run_arrivals(llm, arr)
        assert tokens_of(on) == tokens_of(off)
        st = llm.engine.stats
        assert st.prefix_hit_tokens > 0 and st.mamba_states_stored > 0 and st.mamba_states_restored > 0, st.as_dict()


def test_fully_matched_block_aligned_prompt_recomputes_last_token(hybrid):
    path, _, vocab = hybrid
    prompt = random_prompts(1, 24, 24, vocab, seed=5)[0]  # 6 blocks of 4
    llm = _prefix_llm(path, True)
    first = llm.generate([prompt], GREEDY)[0].generated_tokens
    second = llm.generate([prompt], GREEDY)[0].generated_tokens
    st = llm.engine.stats
    assert first == second
    assert st.prefix_hit_tokens == 20, st.as_dict()  # 5 blocks skipped, the last block recomputed


def test_mamba_cache_lru_eviction(hybrid):
    path, ref, vocab = hybrid
    llm = _prefix_llm(path, True)
    cache = llm.context.mamba.prefix_cache
    # budget for exactly two states
    per_state = sum(t[0].numel() * t.element_size() for t in cache.conv + cache.ssm)
    llm = _prefix_llm(path, True, mamba_gb=2.5 * per_state / 1e9)
    assert llm.context.mamba.prefix_cache.capacity == 2
    prompts = random_prompts(4, 13, 13, vocab, seed=6)
    base = _prefix_llm(path, False).generate(prompts, GREEDY)
    outs = llm.generate(prompts, GREEDY)
    assert [o.generated_tokens for o in outs] == [o.generated_tokens for o in base]
    assert llm.engine.stats.mamba_states_evicted > 0
    # the oldest prompt's state was evicted: resubmitting it skips nothing
    hits = llm.engine.stats.prefix_hit_tokens
    again = llm.generate([prompts[0]], GREEDY)[0].generated_tokens
    assert again == base[0].generated_tokens and llm.engine.stats.prefix_hit_tokens == hits


def test_kv_eviction_invalidates_mamba_state(hybrid):
    path, _, vocab = hybrid
    llm = _prefix_llm(path, True, num_kv_blocks=11)  # 10 usable blocks of 4
    p1 = random_prompts(1, 21, 21, vocab, seed=7)[0]
    p2 = random_prompts(1, 31, 31, vocab, seed=8)[0]  # 31 + 8 tokens need every block
    llm.generate([p1], GREEDY)
    cache = llm.context.mamba.prefix_cache
    assert cache.stored > 0
    llm.generate([p2], GREEDY)  # reclaims all of p1's cached blocks
    assert cache.evicted > 0
    hits = llm.engine.stats.prefix_hit_tokens
    out = llm.generate([p1], GREEDY)[0].generated_tokens
    assert llm.engine.stats.prefix_hit_tokens == hits
    assert out == _prefix_llm(path, False).generate([p1], GREEDY)[0].generated_tokens


def test_budget_too_small_warns_and_disables(hybrid, caplog):
    path, _, _ = hybrid
    with caplog.at_level("WARNING", logger="megatron_async"):
        llm = _prefix_llm(path, True, mamba_gb=1e-12)
    assert llm.context.mamba.prefix_cache is None
    assert "Mamba prefix caching is off" in caplog.text
