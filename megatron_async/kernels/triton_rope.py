"""Rotary embedding of q and k in one kernel, optionally after Qwen3's per-head RMSNorm.

Rounding follows the torch path step by step: the norm's output is rounded to the
activation dtype before its weight multiply and after it, and each rotary product and sum
(``x1 * cos - x2 * sin``, HF's rotate_half convention) is rounded as the bf16 torch ops
round it; products of two bf16 values are exact in float32, so the result is bit-identical
to the torch path for rope without norm. Only the first ``rot_dim`` dims of a head rotate
(partial rotary); the rest are copied. Storing k and v into an e4m3 cache, each value is
rounded to the activation dtype as above, then quantized as ``triton_kv_append`` does (times the
reciprocal of the KV head's power-of-two scale, round to nearest even, saturating).

A TP rank's qkv projection at decode sizes may hand its float32 K-split partials instead of q, k
and v (``splits`` > 1, ``triton_split_linear.tp_rank_tiles``): each value is their sum in split
order, rounded to the activation dtype, as ``PendingSplitSum.reduce()`` rounds it, so the result
is the same bits and the split costs no reduce kernel of its own."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_fp8_common import emulate, pow2_reciprocal, to_e4m3
from megatron_async.kernels.triton_paged_common import check_cache, kv_scale_args


@triton.jit
def _summed(ptr, split_stride, mask, SPLITS: tl.constexpr, DT: tl.constexpr):
    """The values at ``ptr`` in float32: loaded, or the sum of ``SPLITS`` float32 partials
    ``split_stride`` apart in split order, rounded to ``DT`` (the GEMM's output dtype)."""
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    if SPLITS > 1:
        for i in tl.static_range(1, SPLITS):
            x += tl.load(ptr + i * split_stride, mask=mask, other=0.0)
        x = x.to(DT).to(tl.float32)
    return x


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    w_ptr,
    act_ptr,
    split_stride,
    tok,
    stride_t,
    stride_h,
    dst_off,
    dst_stride_h,
    keep,
    c,
    s,
    eps,
    inv,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    CHECK_KEEP: tl.constexpr,
    KV_FP8: tl.constexpr,
    EMULATE: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Head h of token ``tok`` goes to ``dst_ptr + dst_off + h * dst_stride_h`` (an output row, or
    the token's paged-cache slot), rounded to the activation dtype (``act_ptr``'s) first (with
    ``KV_FP8``, then times ``inv[h]`` to e4m3); nothing when not ``keep``. ``SPLITS`` > 1: ``src``
    holds float32 partials ``split_stride`` apart (``_summed``)."""
    HALF: tl.constexpr = ROT_DIM // 2
    dt = act_ptr.dtype.element_ty
    out_dt = dst_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    store_mask = mask & keep if CHECK_KEEP else mask
    src = src_ptr + tok * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    dst = dst_ptr + dst_off + offs_h[:, None] * dst_stride_h + offs_d[None, :]
    x1 = _summed(src, split_stride, mask, SPLITS, dt)
    x2 = _summed(src + HALF, split_stride, mask, SPLITS, dt)
    if HAS_NORM:  # the wrapper guarantees ROT_DIM == HEAD_DIM here
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        w1 = tl.load(w_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
        x1 = (w1[None, :] * (x1 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2[None, :] * (x2 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    o1 = (x1 * c[None, :]).to(dt).to(tl.float32) - (x2 * s[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * c[None, :]).to(dt).to(tl.float32) + (x1 * s[None, :]).to(dt).to(tl.float32)
    tl.store(dst, _out(o1.to(dt), inv, out_dt, KV_FP8, EMULATE), mask=store_mask)
    tl.store(dst + HALF, _out(o2.to(dt), inv, out_dt, KV_FP8, EMULATE), mask=store_mask)
    if ROT_DIM < HEAD_DIM:
        offs_p = tl.arange(0, BLOCK_PASS)
        pmask = (offs_h[:, None] < NUM_HEADS) & (offs_p[None, :] < HEAD_DIM - ROT_DIM)
        src_p = src_ptr + tok * stride_t + offs_h[:, None] * stride_h + ROT_DIM + offs_p[None, :]
        dst_p = dst_ptr + dst_off + offs_h[:, None] * dst_stride_h + ROT_DIM + offs_p[None, :]
        passed = _summed(src_p, split_stride, pmask, SPLITS, dt).to(dt)
        tl.store(dst_p, _out(passed, inv, out_dt, KV_FP8, EMULATE), mask=pmask & keep if CHECK_KEEP else pmask)


@triton.jit
def _out(x, inv, out_dt, KV_FP8: tl.constexpr, EMULATE: tl.constexpr):
    """x (activation dtype, [heads, dims]) as stored: cast, or quantized with the heads' reciprocal scales."""
    if KV_FP8:
        return to_e4m3(x.to(tl.float32) * inv[:, None], EMULATE)
    return x.to(out_dt)


@triton.jit
def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    q_out_ptr,
    k_out_ptr,
    v_out_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_cb,
    stride_cs,
    stride_ch,
    eps,
    kv_scale_ptr,
    split_stride,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    TO_CACHE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    EMULATE: tl.constexpr,
    SPLITS: tl.constexpr,
):
    # Per token, program (tok, 0) rotates the q heads and (tok, 1) the k heads (and stores v):
    # two short dependent chains per token instead of one long one (decode runs few tokens).
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < ROT_DIM // 2
    c = tl.load(cos_ptr + tok * stride_cos + offs_d, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * stride_sin + offs_d, mask=dmask, other=0.0).to(tl.float32)
    if tl.program_id(1) == 0:
        _rotate_heads(q_ptr, q_out_ptr, qw_ptr, cos_ptr, split_stride, tok, stride_qt, stride_qh,
                      tok * (NUM_Q_HEADS * HEAD_DIM), HEAD_DIM, 0, c, s, eps, c, NUM_Q_HEADS, HEAD_DIM, ROT_DIM, BLOCK_HQ,
                      BLOCK_HALF, BLOCK_PASS, HAS_NORM, False, False, EMULATE, SPLITS)
    elif TO_CACHE:  # k and v straight into the token's paged-cache slot (the attention reads them there)
        slot = tl.load(slot_ptr + tok)
        keep = (tl.zeros([1, 1], dtype=tl.int64) + slot) >= 0  # padded token (graph filler): store nothing
        cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        offs_h = tl.arange(0, BLOCK_HK)
        k_inv = tl.zeros([BLOCK_HK], tl.float32) + 1.0
        v_inv = k_inv
        if KV_FP8:  # 1 / scale per KV head (powers of two: exact)
            h_mask = offs_h < NUM_K_HEADS
            k_inv = pow2_reciprocal(tl.load(kv_scale_ptr + offs_h, mask=h_mask, other=1.0))
            v_inv = pow2_reciprocal(tl.load(kv_scale_ptr + NUM_K_HEADS + offs_h, mask=h_mask, other=1.0))
        _rotate_heads(k_ptr, k_out_ptr, kw_ptr, cos_ptr, split_stride, tok, stride_kt, stride_kh, cache_off,
                      stride_ch, keep, c, s, eps, k_inv, NUM_K_HEADS, HEAD_DIM, ROT_DIM, BLOCK_HK, BLOCK_HALF,
                      BLOCK_PASS, HAS_NORM, True, KV_FP8, EMULATE, SPLITS)
        offs_v = tl.arange(0, BLOCK_D)
        vmask = (offs_h[:, None] < NUM_K_HEADS) & (offs_v[None, :] < HEAD_DIM)
        v = _summed(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :], split_stride, vmask,
                    SPLITS, cos_ptr.dtype.element_ty).to(cos_ptr.dtype.element_ty)
        tl.store(v_out_ptr + cache_off + offs_h[:, None] * stride_ch + offs_v[None, :],
                 _out(v, v_inv, v_out_ptr.dtype.element_ty, KV_FP8, EMULATE), mask=vmask & keep)
    else:
        _rotate_heads(k_ptr, k_out_ptr, kw_ptr, cos_ptr, split_stride, tok, stride_kt, stride_kh,
                      tok * (NUM_K_HEADS * HEAD_DIM), HEAD_DIM, 0, c, s, eps, c, NUM_K_HEADS, HEAD_DIM, ROT_DIM, BLOCK_HK,
                      BLOCK_HALF, BLOCK_PASS, HAS_NORM, False, False, EMULATE, SPLITS)


def num_warps(num_q_heads: int, block_half: int) -> int:
    """Warps per program (a function so ``python -m benchmarks kernel-times small-kernels`` can sweep it)."""
    return 4 if num_q_heads * block_half >= 1024 else 1


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    v: torch.Tensor | None = None,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    splits: int = 1,
    split_stride: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q [T, H, D] and k [T, KVH, D] (unit last stride, any token/head strides) by
    cos/sin [T, R/2] (R <= D the rotary dims; the model's table rows at each token's position).

    With both norm weights ([D]), each head is RMS-normalised (eps) first, as Qwen3 does.
    All tensors share one dtype and have a unit last stride. Returns new contiguous q and k.
    ``splits`` > 1: q, k (and v) are views of the first of ``splits`` float32 partials,
    ``split_stride`` elements apart (a ``PendingSplitSum``'s), whose rounded sum is the value.

    With ``kv_cache`` (one layer's ``[2, blocks, block_size, KVH, D]``), ``v`` and
    ``slot_mapping``, the rotated k and v are stored at the tokens' flat slots instead (what
    ``triton_kv_append.append_kv`` would store, negative slots skipped): one kernel fewer per
    attention layer; returns (q, None). An e4m3 cache quantizes with ``kv_scale`` [2, KVH]."""
    num_tokens, hq, d = q.shape
    hk, rot, dtype = k.shape[1], 2 * cos.shape[-1], cos.dtype
    has_norm = q_norm_weight is not None
    tensors = [cos, sin] + ([q_norm_weight, k_norm_weight] if has_norm else [])
    value_dtype = torch.float32 if splits > 1 else dtype
    if (
        k.shape != (num_tokens, hk, d) or cos.shape != sin.shape or cos.shape[0] != num_tokens or rot > d
        or any(t is None or t.stride(-1) != 1 or t.dtype != dtype for t in tensors)
        or any(t.stride(-1) != 1 or t.dtype != value_dtype for t in (q, k)) or splits < 1
    ):
        raise ValueError(f"rope_qk: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                         f"cos {tuple(cos.shape)} {cos.dtype} do not fit together")
    if has_norm != (k_norm_weight is not None) or (has_norm and (rot != d or q_norm_weight.shape != (d,)
                                                                 or k_norm_weight.shape != (d,))):
        raise ValueError("rope_qk: q/k norm needs both weights, of shape [head_dim], and full rotary")
    q_out = torch.empty((num_tokens, hq, d), dtype=dtype, device=q.device)
    to_cache = kv_cache is not None
    if to_cache:
        check_cache(kv_cache, k)
        if v is None or slot_mapping is None or v.shape != k.shape or v.stride(-1) != 1 or v.dtype != value_dtype \
                or tuple(kv_cache.shape[3:]) != (hk, d):
            raise ValueError(f"rope_qk: v {None if v is None else tuple(v.shape)} / cache "
                             f"{tuple(kv_cache.shape)} do not fit k {tuple(k.shape)}")
        k_out, v_out = kv_cache[0], kv_cache[1]
    else:
        k_out = v_out = torch.empty((num_tokens, hk, d), dtype=dtype, device=k.device)
    if num_tokens == 0:
        return q_out, None if to_cache else k_out
    block_half = triton.next_power_of_2(rot // 2)
    vv = v if to_cache else k
    cache_strides = (k_out.stride(0), k_out.stride(1), k_out.stride(2)) if to_cache else (0, 0, 0)
    scale_ptr, fp8 = kv_scale_args(kv_cache, kv_scale, q) if to_cache else (q, False)
    _rope_qk_kernel[(num_tokens, 2)](
        q, k, vv, cos, sin,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,
        q_out, k_out, v_out, slot_mapping if to_cache else q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        cos.stride(0), sin.stride(0), *cache_strides, eps, scale_ptr, split_stride,
        NUM_Q_HEADS=hq, NUM_K_HEADS=hk, HEAD_DIM=d, ROT_DIM=rot,
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk), BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(max(d - rot, 1)), BLOCK_D=triton.next_power_of_2(d), HAS_NORM=has_norm,
        TO_CACHE=to_cache, BLOCK_SIZE=kv_cache.shape[2] if to_cache else 1, KV_FP8=fp8,
        EMULATE=emulate(_rope_qk_kernel), SPLITS=splits,
        num_warps=num_warps(hq, block_half),
        # no mul+add -> FMA contraction: it skips the rounding of each product to the activation
        # dtype that the torch ops do (22 % of fp16 / bf16 elements 1 ulp off with it on)
        enable_fp_fusion=False,
    )
    return q_out, None if to_cache else k_out
