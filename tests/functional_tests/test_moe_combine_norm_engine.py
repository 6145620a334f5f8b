"""A MoE model whose routed experts take the grouped GEMM leaves each MoE layer's slot sum to the
next block's norm (``moe_grouped_mm.PendingCombine``, one kernel: sum + residual add + RMSNorm):
the engine's tokens equal those with that deferral switched off, and the fused kernel ran.

CPU: the grouped GEMM's torch fallback stands in for CUDA's (``use_grouped_mm`` forced), and
the fused kernel runs interpreted (its CUDA-only gate opened). CUDA (``gpu``): a bf16 model on
the real grouped-GEMM path, prefill batches large enough for it, both sides on the device."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.kernels import moe_experts, moe_grouped_mm, triton_moe_combine  # noqa: E402
from megatron_async.models.layers.moe import MoEMixer  # noqa: E402
from tests.helpers.engine_harness import random_prompts  # noqa: E402
from tests.helpers.hf_moe_models import make_tiny_moe_checkpoint  # noqa: E402

GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=4, ignore_eos=True)


def _spy_fused(monkeypatch) -> list[int]:
    calls, real = [], triton_moe_combine.combine_add_rms_norm
    monkeypatch.setattr(triton_moe_combine, "combine_add_rms_norm",
                        lambda *a: calls.append(a[0].shape[1]) or real(*a))
    return calls


def _tokens(llm: LLM, prompts, defer: bool) -> list[list[int]]:
    mixers = [m for m in llm.model.modules() if isinstance(m, MoEMixer)]
    assert mixers
    for m in mixers:
        m.defer_reduction = defer
    return [o.generated_tokens for o in llm.generate(prompts, GREEDY)]


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU engine with the interpreted Triton kernels (TRITON_INTERPRET=1, set by conftest)")
def test_deferred_moe_combine_gives_the_tokens_of_the_plain_combine(monkeypatch, tmp_path):
    path = make_tiny_moe_checkpoint("Qwen3MoeForCausalLM", tmp_path / "moe", num_hidden_layers=2, mlp_only_layers=[])
    monkeypatch.setattr(moe_experts, "use_grouped_mm", lambda *a: True)
    monkeypatch.setattr(moe_grouped_mm, "combine_fuses_norm",
                        lambda p, residual, weight: p.out_dtype == residual.dtype == weight.dtype)
    calls = _spy_fused(monkeypatch)
    llm = LLM(model=str(path), device="cpu", inference_config=InferenceConfig(
        attention_backend="triton", max_requests=4, max_tokens=32, num_kv_blocks=32, block_size_tokens=4,
        max_sequence_length=64, async_scheduling=False))
    prompts = random_prompts(3, 3, 12, 256, seed=7)
    plain = _tokens(llm, prompts, defer=False)
    assert not calls
    assert _tokens(llm, prompts, defer=True) == plain
    assert calls  # every MoE layer's sum went through the fused kernel (the last one into the final norm)


@pytest.mark.gpu
def test_gpu_grouped_mm_deferred_combine_gives_identical_tokens(monkeypatch, tmp_path):
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the grouped GEMM path needs sm90 / sm100")
    path = make_tiny_moe_checkpoint("Qwen3MoeForCausalLM", tmp_path / "moe")
    grouped = []
    use = moe_experts.use_grouped_mm
    monkeypatch.setattr(moe_experts, "use_grouped_mm", lambda *a: grouped.append(use(*a)) or grouped[-1])
    calls = _spy_fused(monkeypatch)
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", inference_config=InferenceConfig(
        attention_backend="triton", max_requests=8, max_tokens=1024, num_kv_blocks=512, max_sequence_length=512,
        cuda_graphs=False))
    # 8 experts, top-2: a step takes the grouped GEMM past 128 tokens
    prompts = random_prompts(6, 150, 300, 256, seed=3)
    calls.clear(), grouped.clear()  # the start-up memory profile ran the largest step already
    plain = _tokens(llm, prompts, defer=False)
    assert any(grouped) and not calls
    assert _tokens(llm, prompts, defer=True) == plain
    assert calls  # the prefill steps summed their slots in the norm's kernel
