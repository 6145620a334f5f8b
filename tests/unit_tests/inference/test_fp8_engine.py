"""The engine with FP8 weights (quantized at load) on CPU: launch-ahead == serial token for token
(with the e4m3 KV cache too, staggered arrivals, sampling); batch-invariant mode keeps a request's
tokens and log-probs whatever shares its steps; MoE experts and Mamba projections in FP8 run;
a bad quantization setting is refused at construction."""
import os

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.engine_harness import Arrival, run_arrivals
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint
from tests.helpers.hf_models import make_tiny_checkpoint

INTERPRETED = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="batch-invariant mode on the CPU engine runs its Triton kernels interpreted (CPU boxes); "
           "on CUDA: test_fp8_gpu_engine.py")
CFG = dict(block_size_tokens=4, num_kv_blocks=96, max_requests=4, max_tokens=16, max_sequence_length=96)
PROMPTS = [[3, 17, 42, 9, 100, 7], [25, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68], [8, 9]]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.8, seed=100 + i, num_tokens_to_generate=9, ignore_eos=True,
                              return_log_probs=True)
    return SamplingParams(top_k=1, num_tokens_to_generate=7 + i, ignore_eos=True, return_log_probs=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("fp8_engine") / "m", seed=0,
                                hidden_size=192, intermediate_size=320, head_dim=32)


@pytest.fixture(scope="module")
def narrow_ckpt(tmp_path_factory):
    """Narrower projections for the Triton-interpreted FP8 GEMMs (their programs scale with the output
    columns): hidden 160 and intermediate 160 still split K into a whole and a partial 128-group.
    One layer: a second runs the same GEMM shapes again."""
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("fp8_narrow") / "m", seed=0,
                                hidden_size=160, intermediate_size=160, head_dim=32, num_attention_heads=2,
                                num_key_value_heads=1, num_hidden_layers=1)


def _run(ckpt, **cfg):
    llm = LLM(str(ckpt), inference_config=InferenceConfig(**{**CFG, **cfg}), quantization="fp8")
    arrivals = [Arrival(step, p, _params(i)) for i, (step, p) in enumerate(zip([0, 0, 2, 5, 9], PROMPTS))]
    outs = run_arrivals(llm, arrivals)
    return [(outs[i].generated_tokens, outs[i].generated_log_probs) for i in range(len(PROMPTS))], llm.engine.stats


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_async_equals_serial(ckpt, kv_cache_dtype):
    """Tokens equal; log-probs to float32 rounding (CPU matmuls round by row count, and a step
    launched ahead may carry other rows). Into an e4m3 KV pool a key or value one float32 ulp
    apart can round to the neighbouring e4m3 value (1/8 of its leading bit), which moves a
    log-prob by more than float32 rounding: 1.6e-5 seen on an AVX-512 CPU."""
    launched, stats = _run(ckpt, kv_cache_dtype=kv_cache_dtype)
    serial, _ = _run(ckpt, kv_cache_dtype=kv_cache_dtype, async_scheduling=False)
    assert [t for t, _ in launched] == [t for t, _ in serial]
    tol = 1e-5 if kv_cache_dtype == "auto" else 1e-3
    for (_, a), (_, b) in zip(launched, serial):
        assert a == pytest.approx(b, abs=tol)
    assert stats.overlapped_decode_steps > 0


@INTERPRETED
def test_batch_invariant_with_fp8_weights(narrow_ckpt):
    """A request alone and beside others (different batch sizes, chunking, decode mixes): the same bits."""
    cfg = InferenceConfig(**CFG, batch_invariant=True)
    llm = LLM(str(narrow_ckpt), inference_config=cfg, quantization="fp8")
    assert llm.model.blocks[0].mixer.qkv_proj.weight_scale_inv is not None
    sp = SamplingParams(top_k=1, num_tokens_to_generate=3, ignore_eos=True, return_log_probs=True)
    together = llm.generate(PROMPTS, [sp] * len(PROMPTS))
    for i in (0, 3):
        alone = llm.generate([PROMPTS[i]], sp)[0]
        assert alone.generated_tokens == together[i].generated_tokens
        assert alone.generated_log_probs == together[i].generated_log_probs


def test_moe_and_mamba_projections_run_in_fp8(tmp_path):
    sp = SamplingParams(top_k=1, num_tokens_to_generate=6, ignore_eos=True)
    cfg = InferenceConfig(**CFG)
    moe = LLM(default_model="tiny-moe", inference_config=cfg, quantization="fp8")
    assert moe.model.blocks[1].mixer.experts.gate_up_proj.weight.element_size() == 1
    hybrid = LLM(str(make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path / "h")), inference_config=cfg,
                 quantization="fp8")
    assert hybrid.model.blocks[0].mixer.in_proj.weight.element_size() == 1
    for llm in (moe, hybrid):
        outs = llm.generate(PROMPTS[:2], sp)
        assert all(len(o.generated_tokens) == 6 for o in outs)


def test_bad_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(inference_config=InferenceConfig(**CFG), quantization="int8")


def test_suspend_and_resume_keep_the_fp8_weights(ckpt):
    sp = SamplingParams(top_k=1, num_tokens_to_generate=6, ignore_eos=True)
    llm = LLM(str(ckpt), inference_config=InferenceConfig(**CFG, enable_suspend=True, kv_cache_dtype="fp8_e4m3"),
              quantization="fp8")
    before = llm.generate(PROMPTS[:2], sp)
    eng = llm.engine
    eng.pause_generation("keep")
    eng.suspend(("weights", "kv_cache"))
    assert llm.model.blocks[0].mixer.qkv_proj.weight.untyped_storage().nbytes() == 0
    eng.resume(("weights", "kv_cache"))
    eng.resume_generation()
    after = llm.generate(PROMPTS[:2], sp)
    assert [o.generated_tokens for o in after] == [o.generated_tokens for o in before]


@INTERPRETED
def test_triton_fp8_linears_match_the_emulation_call_by_call(tmp_path, monkeypatch):
    """Batch-invariant mode runs the FP8 linears through the Triton kernels (the CUDA path,
    interpreted here): every call the engine makes, on its own activations, gives the emulation's
    activation bits and its output to float32 rounding (``Fp8CallChecks``). q/k/v of 192/64/64
    rows (one scale row per weight row), K of 192, 256 and 320 (a partial last
    group, a ragged K split), a 16-row prefill step, 2 and 1 decode rows. Log-probs are not compared end to end: a float32 ulp that tips one activation
    across an e4m3 rounding midpoint moves this checkpoint's log-probs by up to ~0.2."""
    from megatron_async.kernels import triton_fp8_gemm
    from tests.helpers.fp8_checks import Fp8CallChecks

    ckpt = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "m", hidden_size=256, intermediate_size=320,
                                num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                                vocab_size=512)
    checks = Fp8CallChecks()
    monkeypatch.setattr(triton_fp8_gemm, "fp8_linear", checks)
    cfg = InferenceConfig(block_size_tokens=16, num_kv_blocks=16, max_requests=2, max_tokens=16,
                          max_sequence_length=64, batch_invariant=True)
    # 11 + 5 prompt tokens fill the first step's 16 rows, then both decode (2 rows), then the longer
    # request alone (1 row)
    sps = [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True) for n in (2, 3)]
    outs = LLM(str(ckpt), inference_config=cfg, quantization="fp8").generate([PROMPTS[2], PROMPTS[3][:5]], sps)
    assert [len(o.generated_tokens) for o in outs] == [2, 3]
    assert checks.failures == []
    assert {1, 2, 16} <= set(checks.rows) and checks.scale_block_ns == {1, 128}
