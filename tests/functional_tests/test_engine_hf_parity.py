"""Engine-level reference parity: greedy tokens of LLM.generate equal HF generate."""
import pytest

from megatron_async import SamplingParams
from tests.helpers.engine_harness import make_llm, random_prompts
from tests.helpers.hf_models import GPT_ARCHS, hf_greedy, load_hf_reference, make_tiny_checkpoint

NEW = 10


@pytest.fixture(scope="module", params=GPT_ARCHS)
def ckpt_and_ref(request, tmp_path_factory):
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), tie_word_embeddings=request.param == "Qwen2ForCausalLM")
    ref = load_hf_reference(path)
    prompts = random_prompts(8, 2, 40, 256, seed=1)
    expected = [hf_greedy(ref, p, NEW) for p in prompts]
    return path, prompts, expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ragged_batch_chunked_prefill_matches_hf(ckpt_and_ref, async_scheduling):
    path, prompts, expected = ckpt_and_ref
    # max_tokens below the longest prompt forces chunked prefill
    llm = make_llm(path, max_tokens=24, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=NEW))
    assert [o.generated_tokens for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    assert max(len(p) for p in prompts) > 24  # chunking really happened
    assert llm.engine.stats.prefill_steps >= 2


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_small_pool_pauses_and_evicts_same_tokens(ckpt_and_ref, async_scheduling):
    path, prompts, expected = ckpt_and_ref
    # 8 requests of up to 50 tokens at block size 4 need ~100 blocks; give 20
    llm = make_llm(path, num_kv_blocks=21, max_tokens=32, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=NEW))
    assert [o.generated_tokens for o in outs] == expected
    st = llm.engine.stats
    assert st.paused > 0 and st.evicted > 0, st.as_dict()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_caching_on_off_same_tokens(ckpt_and_ref, async_scheduling):
    path, _, _ = ckpt_and_ref
    shared = random_prompts(1, 23, 23, 256, seed=7)[0]
    tails = random_prompts(6, 1, 9, 256, seed=8)
    prompts = [shared + t for t in tails]
    results = {}
    for caching in (False, True):
        llm = make_llm(path, enable_prefix_caching=caching, async_scheduling=async_scheduling, max_requests=2)
        outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=NEW))
        results[caching] = ([o.generated_tokens for o in outs], llm.engine.stats.prefix_hit_tokens)
    assert results[True][0] == results[False][0]
    assert results[False][1] == 0 and results[True][1] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_request_alone_equals_inside_busy_batch(ckpt_and_ref, async_scheduling):
    """A seeded top-k/top-p request gives the same tokens alone and among 7 other requests
    (arriving at other times, with other params), under memory pressure."""
    path, prompts, _ = ckpt_and_ref
    sp = SamplingParams(temperature=1.1, top_k=40, top_p=0.9, seed=77, num_tokens_to_generate=15)
    alone = make_llm(path, async_scheduling=async_scheduling).generate([prompts[3]], sp)[0].generated_tokens
    others = [SamplingParams(temperature=0.7, seed=i, num_tokens_to_generate=5 + 2 * i) for i in range(8)]
    others[3] = sp
    llm = make_llm(path, async_scheduling=async_scheduling, num_kv_blocks=30, max_tokens=24)
    busy = llm.generate(prompts, others)
    assert busy[3].generated_tokens == alone
    assert llm.engine.stats.paused > 0  # the busy run really was squeezed
    greedy = make_llm(path).generate([prompts[3]], SamplingParams(top_k=1, num_tokens_to_generate=15))[0]
    assert greedy.generated_tokens != alone  # it really sampled
