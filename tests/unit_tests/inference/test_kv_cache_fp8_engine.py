"""The engine with an e4m3 KV pool (``kv_cache_dtype="fp8_e4m3"``): the pool really is e4m3 and
changes the numbers, and every path that reuses or moves cached KV gives the tokens and log-probs
of an uninterrupted run with the same pool: prefix hits, chunked prefill, eviction + recompute,
suspend / resume, n-gram speculative verify, launch-ahead vs serial, the Triton kernels vs the
torch backend. Each test asserts that its situation really happened (the engine's counters)."""
import dataclasses

import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.unit_tests.inference.engine_driver import drive

CFG = dict(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=64, max_sequence_length=96,
           kv_cache_dtype="fp8_e4m3")
SHARED = list(range(30, 50))
PROMPTS = [SHARED + [7, 8, 9], SHARED + [11, 12], [5, 6, 7, 8, 9, 10], list(range(60, 90))]


def _params(n=12):
    return [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True, return_log_probs=True),
            SamplingParams(temperature=0.8, seed=3, num_tokens_to_generate=n, ignore_eos=True, return_log_probs=True),
            SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True, return_log_probs=True),
            SamplingParams(temperature=0.9, top_k=20, seed=4, num_tokens_to_generate=n, ignore_eos=True,
                           return_log_probs=True)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("kv_fp8") / "m", seed=0)


def _llm(ckpt, **cfg):
    return LLM(str(ckpt), inference_config=InferenceConfig(**{**CFG, **cfg}))


def _run(llm, prompts=PROMPTS, params=None):
    eng = llm.engine
    for p, sp in zip(prompts, params or _params()):
        eng.add_request(p, sp)
    outs, _ = drive(eng)
    return [(outs[r].generated_tokens, outs[r].generated_log_probs) for r in sorted(outs)]


@pytest.fixture(scope="module")
def reference(ckpt):
    """All four at once, an ample pool, launch-ahead, the torch backend."""
    llm = _llm(ckpt)
    assert all(t.dtype == torch.float8_e4m3fn for t in llm.context.kv_caches)
    return _run(llm)


def _same(a, b):
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, lp_a), (_, lp_b) in zip(a, b):
        assert lp_a == pytest.approx(lp_b, abs=1e-5)


def test_e4m3_pool_changes_the_numbers_but_not_much(ckpt, reference):
    full = _run(_llm(ckpt, kv_cache_dtype="auto"))
    first = [abs(a[0] - b[0]) for (_, a), (_, b) in zip(full, reference)]  # before sampled tokens diverge
    assert 0 < max(first) < 0.5


def test_pool_holds_twice_the_blocks_in_the_same_bytes(ckpt):
    sized = dict(num_kv_blocks=None, buffer_size_gb=0.001)
    fp8, full = _llm(ckpt, **sized).context, _llm(ckpt, **sized, kv_cache_dtype="auto").context
    assert fp8.kv_caches[0].element_size() == 1 and full.kv_caches[0].element_size() == 4  # float32 model
    assert abs(fp8.num_kv_blocks - 4 * full.num_kv_blocks) <= 4


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_prefix_hits_and_chunking_change_nothing(ckpt, reference, async_scheduling):
    llm = _llm(ckpt, enable_prefix_caching=True, max_tokens=8, async_scheduling=async_scheduling)
    _same(_run(llm), reference)
    assert llm.engine.stats.prefix_hit_tokens > 0


def test_eviction_and_recompute_change_nothing(ckpt, reference):
    llm = _llm(ckpt, num_kv_blocks=14, max_tokens=16)
    _same(_run(llm), reference)
    assert llm.engine.stats.evicted > 0


def test_suspend_and_resume_keep_the_e4m3_blocks(ckpt, reference):
    llm = _llm(ckpt, enable_suspend=True)
    eng = llm.engine
    for p, sp in zip(PROMPTS, _params()):
        eng.add_request(p, sp)
    outs = {}
    for _ in range(6):
        outs.update((o.request_id, o) for o in eng.step().finished)
    eng.pause_generation("keep")
    outs.update((o.request_id, o) for o in eng.step().finished)
    assert any(r.block_ids for r in eng.context.active.values())
    eng.suspend(("weights", "kv_cache"))
    eng.resume(("weights",))
    eng.resume(("kv_cache",))
    eng.resume_generation()
    rest, _ = drive(eng)
    outs.update(rest)
    _same([(outs[r].generated_tokens, outs[r].generated_log_probs) for r in sorted(outs)], reference)


def test_ngram_speculation_changes_nothing(ckpt):
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 8, 9, 8, 9, 8, 9]]
    params = [SamplingParams(top_k=1, num_tokens_to_generate=16, ignore_eos=True, return_log_probs=True)] * 2
    plain = _run(_llm(ckpt), prompts, params)
    llm = _llm(ckpt, num_speculative_tokens=3, speculative_method="ngram", speculative_min_acceptance=0.0)
    _same(_run(llm, prompts, params), plain)
    assert llm.engine.stats.spec_draft_tokens > 0


def test_triton_kernels_match_the_torch_backend(ckpt, reference):
    """The fused append and the paged kernels (interpreter on CPU) over the same e4m3 bytes: the
    reference's first 6 tokens (decode steps read pages both the prefill and earlier decodes wrote;
    the seeded draws depend on the position, not on the length asked for)."""
    llm = _llm(ckpt, attention_backend="triton")
    got = _run(llm, params=_params(6))
    assert [t for t, _ in got] == [t[:6] for t, _ in reference]
    for (_, a), (_, b) in zip(got, reference):
        assert a == pytest.approx(b[:6], abs=1e-4)


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        InferenceConfig(kv_cache_dtype="int8").validate()
    config = dataclasses.replace(InferenceConfig(), kv_cache_dtype="fp8")
    config.validate()
    assert config.cache_sizing().kv_cache_dtype == "fp8"
