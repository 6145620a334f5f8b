"""Decode attention with the rope kernel's work folded in (``DecodeRope``): rotary and Qwen3's
per-head norm of q and of the new k, the new k / v stored at their slots, then attention, in
one kernel. Against the two-kernel path (``rope_qk`` into the cache, then ``decode_attention``):
the same cache bits, the same output (up to FMA contraction on the GPU), with one and several
key splits (only the split holding the last key stores), GQA, fp32 and bf16."""
import pytest
import torch

from megatron_async.kernels.attention import DecodeRope
from megatron_async.kernels.triton_decode_attention import decode_attention
from megatron_async.kernels.triton_rope import rope_qk
from paged_attention_cases import make_case

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_fused_rope_decode_equals_rope_then_decode(dtype, norm, splits):
    rows = [(c, 1) for c in (0, 5, 16, 37, 63)]  # cached keys; the new one lands at position c
    case = make_case(rows, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=dtype, device=DEV,
                     seed=splits + 2 * norm)
    g = torch.Generator(device=DEV).manual_seed(7)
    R, D = len(rows), 32
    qkv = torch.randn(R, (4 + 2 * 2) * D, generator=g, device=DEV).to(dtype)  # strided views, as the projection
    q, k, v = (t.view(R, -1, D) for t in qkv.split([4 * D, 2 * D, 2 * D], dim=-1))
    angles = case.meta.positions[:, None].float() * torch.rand(D // 2, generator=g, device=DEV)[None, :]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    w = (torch.rand(D, generator=g, device=DEV) + 0.5).to(dtype)
    qw, kw, eps = (w, w.flip(0).contiguous(), 1e-6) if norm else (None, None, 0.0)

    cache_ref = torch.nan_to_num(case.kv_cache.clone(), nan=0.0)
    q_rot, _ = rope_qk(q, k, cos, sin, qw, kw, eps, v=v, kv_cache=cache_ref, slot_mapping=case.meta.slot_mapping)
    expected = decode_attention(q_rot, cache_ref, case.meta, case.scale, num_splits=splits)

    cache = torch.nan_to_num(case.kv_cache.clone(), nan=0.0)
    got = decode_attention(q, cache, case.meta, case.scale, num_splits=splits,
                           rope=DecodeRope(k, v, cos, sin, qw, kw, eps))
    assert torch.equal(cache, cache_ref)  # every new k / v stored once, rotated exactly as the rope kernel
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, expected, **tol)
    if DEV == "cpu":  # the interpreter has no FMA contraction: the same bits
        assert torch.equal(got, expected)
