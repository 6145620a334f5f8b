"""Fused KV-cache append: one kernel stores a step's keys and values at their flat slots (an e4m3
cache: times the exact reciprocal of the layer's power-of-two scale per KV head, rounded to
nearest even, saturating; see kv_cache_fp8)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_fp8_common import emulate, pow2_reciprocal, to_e4m3
from megatron_async.kernels.triton_paged_common import check_cache, kv_scale_args


@triton.jit
def _append_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    kv_scale_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    EMULATE: tl.constexpr,
):
    # One program per token: all KV heads of its K and V at once.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:  # padded token (e.g. a CUDA-graph filler): nothing to store
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    if KV_FP8:
        h_mask = offs_h < NUM_KV_HEADS
        k_inv = pow2_reciprocal(tl.load(kv_scale_ptr + offs_h, mask=h_mask, other=1.0))
        v_inv = pow2_reciprocal(tl.load(kv_scale_ptr + NUM_KV_HEADS + offs_h, mask=h_mask, other=1.0))
        tl.store(k_cache_ptr + dst, to_e4m3(k.to(tl.float32) * k_inv[:, None], EMULATE), mask=mask)
        tl.store(v_cache_ptr + dst, to_e4m3(v.to(tl.float32) * v_inv[:, None], EMULATE), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def append_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              kv_scale: torch.Tensor | None = None) -> None:
    """Write k, v ([T, KVH, D]) to ``kv_cache`` at flat slots ``slot_mapping[:T]``
    (block_id * block_size + offset); a negative slot skips its token. An e4m3 cache quantizes
    with ``kv_scale`` [2, KVH] (powers of two)."""
    check_cache(kv_cache, k)
    num_tokens, kvh, d = k.shape
    if num_tokens == 0:
        return
    if v.shape != k.shape or v.stride(-1) != 1 or tuple(kv_cache.shape[3:]) != (kvh, d):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache {tuple(kv_cache.shape)}")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    scale_ptr, fp8 = kv_scale_args(kv_cache, kv_scale, k)
    _append_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scale_ptr, KV_FP8=fp8, EMULATE=emulate(_append_kv_kernel),
        NUM_KV_HEADS=kvh, HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d),
        BLOCK_SIZE=kv_cache.shape[2],
        num_warps=4,
    )
