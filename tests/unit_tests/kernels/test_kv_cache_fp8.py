"""The e4m3 KV cache: the append (Triton and torch), the fused rope store, and the decode / prefill
kernels and the torch backend reading it, against the torch reference over the dequantized pool.
Unused cache slots hold NaN (see paged_attention_cases): a kernel reading one fails."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import attention, attention_torch, kv_cache_fp8 as kf  # noqa: E402
from megatron_async.config import AttentionBackend  # noqa: E402
from megatron_async.kernels.triton_decode_attention import decode_attention  # noqa: E402
from megatron_async.kernels.triton_kv_append import append_kv  # noqa: E402
from megatron_async.kernels.triton_prefill_attention import prefill_attention  # noqa: E402
from megatron_async.kernels.triton_rope import rope_qk  # noqa: E402

from tests.helpers.paged_attention_cases import make_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DECODE_ROWS = [(0, 1), (3, 1), (4, 1), (7, 1), (16, 1), (40, 1)]
MIXED_ROWS = [(0, 7), (9, 6), (5, 1), (0, 1), (3, 21), (12, 1), (16, 3)]
SCALES = torch.tensor([[1.0, 0.25], [2.0, 0.5]])
"""(keys, values) x 2 KV heads, powers of two."""


def _pool(rows, group, head_dim, block_size, scales, seed=0, magnitude=(30.0, 0.2)):
    """A case whose cached tokens (x magnitude) sit quantized in an e4m3 pool, and its k / v scaled alike."""
    case = make_case(rows, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                     device=DEVICE, seed=seed)
    mag = torch.tensor(magnitude, device=DEVICE).view(2, 1, 1, 1, 1)
    pool = ((case.kv_cache * mag) / scales.to(DEVICE).view(2, 1, 1, -1, 1)).clamp(-448, 448).to(kf.FP8_KV)
    return case, pool, case.k * magnitude[0], case.v * magnitude[1]


def _reference(case, pool, k, v, scales):
    """Torch reference: the step's k / v written by the torch path, then attention over the
    dequantized NaN-free pool."""
    ref_pool = torch.nan_to_num(pool.float(), nan=0.0).to(kf.FP8_KV)
    kf.write_kv_fp8(ref_pool, k, v, case.meta.slot_mapping, scales)
    return attention_torch.paged_attention(case.q, ref_pool.float() * scales.view(2, 1, 1, -1, 1), case.meta,
                                           case.scale), ref_pool


@pytest.mark.parametrize("block_size,group,head_dim", [(4, 1, 32), (8, 2, 16), (16, 4, 64), (16, 4, 48), (8, 2, 256)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_e4m3_with_folded_scales(block_size, group, head_dim, splits, q_dtype):
    """fp32 queries take fp32 dots; bf16 ones the int16-pair path (float16 halves, the scales and its
    2**-8 folded), equal to the reference within the float16 probabilities and the bf16 output."""
    scales = SCALES.to(DEVICE)
    case, pool, k, v = _pool(DECODE_ROWS, group, head_dim, block_size, scales, seed=block_size + group)
    ref, ref_pool = _reference(case, pool, k, v, scales)
    append_kv(pool, k, v, case.meta.slot_mapping, scales)
    assert torch.equal(torch.nan_to_num(pool.float(), nan=0.0), ref_pool.float())
    q = case.q.to(q_dtype)
    if q_dtype != torch.float32:  # the reference over the same rounded queries
        ref, _ = _reference(dataclasses.replace(case, q=q.float()), pool, k, v, scales)
    tol = dict(rtol=1e-4, atol=1e-5) if q_dtype == torch.float32 else dict(rtol=1e-2, atol=2e-3)
    out = decode_attention(q, pool, case.meta, case.scale, num_splits=splits, kv_scale=scales)
    torch.testing.assert_close(out.float(), ref, **tol)
    wrong = decode_attention(q, pool, case.meta, case.scale, num_splits=splits, kv_scale=torch.ones_like(scales))
    assert not torch.allclose(wrong.float(), ref, rtol=1e-2, atol=1e-2)  # the scales are really applied


@pytest.mark.parametrize("fixed_order,q_dtype,head_dim", [(False, torch.float32, 32), (True, torch.float32, 32),
                                                          (False, torch.bfloat16, 32), (False, torch.bfloat16, 48),
                                                          (False, torch.bfloat16, 16), (True, torch.bfloat16, 32)])
def test_prefill_reads_e4m3_with_folded_scales(fixed_order, q_dtype, head_dim):
    """fp32 queries take fp32 dots; bf16 ones the int16-pair path of the prefill kernel (float16
    halves; head_dim 48 masks the pairs past it, 16 pads each half to a 16-wide dot), equal to the
    reference over the same rounded queries within the float16 probabilities and the bf16 output."""
    scales = SCALES.to(DEVICE)
    case, pool, k, v = _pool(MIXED_ROWS, 2, head_dim, 4, scales, seed=3 + head_dim)
    ref, _ = _reference(case, pool, k, v, scales)
    append_kv(pool, k, v, case.meta.slot_mapping, scales)
    q = case.q.to(q_dtype)
    if q_dtype != torch.float32:
        ref, _ = _reference(dataclasses.replace(case, q=q.float()), pool, k, v, scales)
    tol = dict(rtol=1e-4, atol=1e-5) if q_dtype == torch.float32 else dict(rtol=1e-2, atol=2e-3)
    out = prefill_attention(q, pool, case.meta, case.scale, fixed_order=fixed_order, kv_scale=scales)
    torch.testing.assert_close(out.float(), ref, **tol)
    wrong = prefill_attention(q, pool, case.meta, case.scale, fixed_order=fixed_order,
                              kv_scale=torch.ones_like(scales))
    assert not torch.allclose(wrong.float(), ref, rtol=1e-2, atol=1e-2)  # the scales are really applied


@pytest.mark.parametrize("kernel", ["decode", "prefill", "invariant"])
def test_bf16_queries_of_any_magnitude_read_e4m3(kernel):
    """bf16 queries over an e4m3 cache, ordinary and far beyond fp16's range (1e5): the kernels
    agree with the reference within the operands' rounding (the dots must not narrow q to fp16)."""
    scales = SCALES.to(DEVICE)
    rows = DECODE_ROWS if kernel == "decode" else MIXED_ROWS
    case, pool, k, v = _pool(rows, 2, 32, 8, scales, seed=5)
    pool = torch.nan_to_num(pool.float(), nan=0.0).to(kf.FP8_KV)
    kf.write_kv_fp8(pool, k, v, case.meta.slot_mapping, scales)
    deq = pool.float() * scales.view(2, 1, 1, -1, 1)
    for magnitude, tol in ((1.0, 2e-2), (1e5, 1e-2)):
        q = (case.q.float() * magnitude / case.q.float().abs().amax()).to(torch.bfloat16)
        if kernel == "decode":
            out = decode_attention(q, pool, case.meta, case.scale, kv_scale=scales)
        else:
            out = prefill_attention(q, pool, case.meta, case.scale, fixed_order=kernel == "invariant", kv_scale=scales)
        ref = attention_torch.paged_attention(q.float(), deq, case.meta, case.scale)
        assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [DECODE_ROWS, MIXED_ROWS, [(0, 9)], [(0, 9), (4, 1), (2, 1)]])
def test_torch_backend_reads_e4m3(rows):
    """Decode, padded mixed rows, and the fresh-prompt shortcut (attention over the step's own k / v,
    which must be what the pool gives back) all equal the reference over the dequantized pool (the
    torch paths read whole blocks: NaN-free here, as in the other torch-backend tests)."""
    scales = SCALES.to(DEVICE)
    case, pool, k, v = _pool(rows, 2, 16, 4, scales, seed=len(rows))
    pool = torch.nan_to_num(pool.float(), nan=0.0).to(kf.FP8_KV)
    ref, ref_pool = _reference(case, pool, k, v, scales)
    out = attention.attend(case.q, k, v, pool, case.meta, case.scale, backend=AttentionBackend.TORCH, kv_scale=scales)
    assert torch.equal(torch.nan_to_num(pool.float(), nan=0.0), ref_pool.float())
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_append_saturates_and_matches_torch_write_bytes():
    scales = torch.tensor([[1.0, 4.0], [0.125, 1.0]], device=DEVICE)
    case = make_case(MIXED_ROWS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, device=DEVICE)
    k = case.k * torch.tensor([1.0, 600.0], device=DEVICE).view(1, 2, 1)  # head 1 beyond 448 x 4: saturates
    k[0, 0, :4] = torch.tensor([2.0 ** -10, -2.0 ** -12, 0.0013, -0.0])  # subnormals, ties, -0
    a = torch.zeros(case.kv_cache.shape, dtype=kf.FP8_KV, device=DEVICE)
    b = a.clone()
    append_kv(a, k, case.v, case.meta.slot_mapping, scales)
    kf.write_kv_fp8(b, k, case.v, case.meta.slot_mapping, scales)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert a.float().abs().max() == 448.0


@pytest.mark.parametrize("norm", [False, True])
def test_rope_stores_into_e4m3_like_rope_then_append(norm):
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]], device=DEVICE)
    case = make_case(MIXED_ROWS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, device=DEVICE,
                     dtype=torch.bfloat16)
    T = case.q.shape[0]
    angles = torch.randn(T, 8, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    w = (torch.rand(16, generator=torch.Generator().manual_seed(6)) + 0.5).to(DEVICE, torch.bfloat16)
    nw = (w, w, 1e-6) if norm else (None, None, 0.0)
    v = case.v * 40
    q_ref, k_ref = rope_qk(case.q, case.k * 40, cos, sin, *nw)
    ref = torch.zeros(case.kv_cache.shape, dtype=kf.FP8_KV, device=DEVICE)
    append_kv(ref, k_ref, v, case.meta.slot_mapping, scales)
    pool = torch.zeros_like(ref)
    q, none = rope_qk(case.q, case.k * 40, cos, sin, *nw, v=v, kv_cache=pool, slot_mapping=case.meta.slot_mapping,
                      kv_scale=scales)
    assert none is None and torch.equal(q, q_ref)
    assert torch.equal(pool.view(torch.uint8), ref.view(torch.uint8))


def test_e4m3_cache_without_scales_is_refused():
    case = make_case(DECODE_ROWS, num_heads=2, num_kv_heads=2, head_dim=16, block_size=4, device=DEVICE)
    pool = torch.zeros(case.kv_cache.shape, dtype=kf.FP8_KV, device=DEVICE)
    with pytest.raises(ValueError, match="kv_scale"):
        append_kv(pool, case.k, case.v, case.meta.slot_mapping)


def test_round_trip_is_what_the_pool_returns():
    scales = torch.tensor([[0.5, 2.0], [1.0, 1.0]])
    x = torch.randn(5, 2, 8) * 10
    pool = torch.zeros(2, 3, 4, 2, 8, dtype=kf.FP8_KV)
    slots = torch.tensor([0, 1, 2, 5, 9])
    kf.write_kv_fp8(pool, x, x, slots, scales)
    back = kf.gather(pool, torch.arange(3), scales)[0].reshape(-1, 2, 8)[slots]
    assert torch.equal(back, kf.round_trip(x, scales[0]))
    assert kf.pool_dtype("fp8", torch.bfloat16) == kf.FP8_KV and kf.pool_dtype("auto", torch.float16) == torch.float16
