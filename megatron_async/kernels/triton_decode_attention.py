"""Decode attention over a paged KV cache (one query token per row), flash-decoding style.

Grid: (kv_heads, rows, splits), KV heads fastest: the cache stores a token's KV heads side
by side, so the programs of one row's heads, started together, read neighbouring bytes
(-2 % at 128 rows, -10 % at 64 rows against rows fastest, same bits). A program takes ALL
query heads that share one KV head (the GQA group, padded to >= 16 rows so ``tl.dot`` can
run on tensor cores: decode is bound by reading K/V, so the padded rows cost nothing that
matters, and each K/V tile is read once per group instead of once per query head). The
row's keys are cut into ``num_splits`` contiguous chunks; each program runs an fp32 online
softmax over its chunk and writes a normalised partial output plus its log-sum-exp, and a
second kernel merges the splits. With one split the first kernel writes the output directly. With
``meta.row_order`` program i of the row axis serves row ``row_order[i]`` (longest first: the
block scheduler starts programs in grid order, so the short rows fill the tail).

CUDA graphs: nothing here depends on the step's data. The row's real KV length is read
from ``meta.kv_lens`` (and its query position from ``meta.positions``) inside the kernel,
the chunk size is derived from it there, and ``num_splits`` comes only from the number
of rows, the KV head count, the device and ``block_table.shape[1]`` (the longest a row
can ever be), never from ``meta.max_kv_len``. So a graph captured once with an upper
bound for ``max_kv_len`` replays correctly for any kv_lens that fit the block table.

An e4m3 cache (``KV_FP8``): the KV head's key scale is folded into the softmax scale and its value
scale multiplies the output (see kv_cache_fp8). With 16-bit queries (``E4M3_PAIRS``) the pool is
read as int16 pairs of neighbouring dims and each tile widens in registers to an even-dims and an
odd-dims float16 half (exact), so the tiles move through shared memory as 16-bit values like a bf16
pool's (16-byte copies in, ldmatrix out, the value tile's transposed read included: e4m3 bytes have
no transposed ldmatrix, the byte-wise reads it fell back to plus e4m3 -> f16 -> bf16, two conversions
a value, held the kernel at ~1.7 TB/s); q.k = q_even.k_even + q_odd.k_odd, the output's halves are
interleaved once at the end. Queries go to float16 scaled by a power of two per head (exact within
float16's range), probabilities too (float16: 3 more mantissa bits than bf16). fp32 queries (tests)
widen the tiles to fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.forward_batch import AttentionMetadata
from megatron_async.kernels import launch_limits
from megatron_async.kernels.decode_splits import choose_num_splits
from megatron_async.kernels.triton_fp8_act import QuantizedRows, attention_outputs, store_heads_quantized
from megatron_async.kernels.triton_fp8_common import emulate
from megatron_async.kernels.triton_paged_common import (
    check_cache, dot_args, kv_scale_args, kv_tile_rows, load_kv, load_q_pairs, q_as_pairs,
    widen_e4m3_pairs,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_split(
    q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_d, d_mask, start, end, scale_log2,
    stride_cb, stride_cs, stride_ch,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The fp32 online softmax of the group's queries over the split's keys [start, end):
    (un-normalised output, sum of exponentials, running max), scores in log2 units."""
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        rows = kv_tile_rows(table_ptr, n0, end, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N, True)
        k = load_kv(k_cache_ptr, rows, offs_d, n_mask, d_mask)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every iteration has >= 1 visible key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv(v_cache_ptr, rows, offs_d, n_mask, d_mask)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_split_e4m3(
    q_e, q_o, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_p, p_mask, start, end, row_scale,
    stride_cb, stride_cs, stride_ch,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """``_attend_split`` over an e4m3 cache read as int16 pairs of neighbouring dims: every tile widens
    to an even-dims and an odd-dims float16 half (``widen_e4m3_pairs``), so the tiles stay 16-bit in
    shared memory (the value tile's transposed read is a 16-bit ldmatrix; e4m3 bytes have none) and
    q.k = q_even.k_even + q_odd.k_odd. Returns the output's even and odd dims separately."""
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_e = tl.zeros([BLOCK_G, BLOCK_P], tl.float32)
    acc_o = tl.zeros([BLOCK_G, BLOCK_P], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        rows = kv_tile_rows(table_ptr, n0, end, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N, True)
        mask = n_mask[:, None] & p_mask[None, :]
        k_e, k_o = widen_e4m3_pairs(tl.load(k_cache_ptr + rows[:, None] + offs_p[None, :], mask=mask, other=0),
                                    USE_ASM)
        s = tl.dot(q_e, tl.trans(k_e))
        s = tl.dot(q_o, tl.trans(k_o), s) * row_scale[:, None]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_e, v_o = widen_e4m3_pairs(tl.load(v_cache_ptr + rows[:, None] + offs_p[None, :], mask=mask, other=0),
                                    USE_ASM)
        p16 = p.to(tl.float16)
        acc_e = acc_e * alpha[:, None] + tl.dot(p16, v_e)
        acc_o = acc_o * alpha[:, None] + tl.dot(p16, v_o)
        m_i = m_new
    return acc_e, acc_o, l_i, m_i


@triton.jit
def _store_split(
    acc, l_i, m_i, row, heads, split, offs_d, g_mask, d_mask, out_ptr, part_out_ptr, part_lse_ptr,
    stride_ot, stride_oh, num_heads, oq_ptr, os_ptr, rows_padded, num_splits, HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr, QUANT_OUT: tl.constexpr, EMULATE: tl.constexpr,
):
    """The split's normalised output: the row's output itself when it is the only split (with
    ``QUANT_OUT`` quantized for an FP8 o projection instead, ``store_heads_quantized``), else a
    partial output plus its log-sum-exp (log2) for the merge kernel."""
    has_keys = l_i > 0.0  # an empty split (or an empty row) contributes nothing
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if not SPLIT and QUANT_OUT:
        store_heads_quantized(o, row + heads * 0, heads, g_mask, oq_ptr, os_ptr, rows_padded, num_heads * 128,
                              out_ptr.dtype.element_ty, EMULATE)
    elif not SPLIT:
        tl.store(
            out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part = (row.to(tl.int64) * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_lse_ptr + part, lse, mask=g_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _split_keys(kv_lens_ptr, positions_ptr, row, split, num_splits, BLOCK_N: tl.constexpr):
    """[start, end) of the keys of split ``split``, of those visible to the row's single query:
    [0, min(kv_len, position + 1)) cut into ``num_splits`` chunks of whole key tiles."""
    kv_len = tl.load(kv_lens_ptr + row).to(tl.int64)
    length = tl.minimum(kv_len, tl.load(positions_ptr + row).to(tl.int64) + 1)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, length)


@triton.jit(do_not_specialize=["num_splits"])  # one binary for every split count (a cold start built 11)
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_lens_ptr,
    positions_ptr,
    row_order_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    num_heads,
    scale_log2,
    kv_scale_ptr,
    num_kv_heads,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    num_splits,
    SPLIT: tl.constexpr,
    ORDERED: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    E4M3_PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, Q_BF16: tl.constexpr, USE_ASM: tl.constexpr,
    oq_ptr, os_ptr, rows_padded, QUANT_OUT: tl.constexpr,
):
    if HEADS_FASTEST:  # a row's KV heads side by side in the grid: they read the same tokens' cache lines
        kv_head = tl.program_id(0)
        row = tl.program_id(1)
    else:
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
    if ORDERED:  # programs start in grid order: the longest rows first, the short ones fill the tail
        row = tl.load(row_order_ptr + row)
    split = tl.program_id(2)

    start, end = _split_keys(kv_lens_ptr, positions_ptr, row, split, num_splits, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    table_ptr = block_table_ptr + row.to(tl.int64) * stride_bt
    if KV_FP8:  # the key scale folded into the softmax scale (powers of two: exact)
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr + kv_head)
    if E4M3_PAIRS:
        q_rows = q_ptr + row.to(tl.int64) * stride_qt + heads * stride_qh
        q_e, q_o, q_up = load_q_pairs(q_rows, g_mask, HEAD_DIM, BLOCK_P, Q_BF16)
        offs_p = tl.arange(0, BLOCK_P)
        acc_e, acc_o, l_i, m_i = _attend_split_e4m3(
            q_e, q_o, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_p, offs_p < HEAD_DIM // 2, start, end,
            q_up * scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_G, BLOCK_P, BLOCK_SIZE, BLOCK_N, USE_ASM)
        acc = tl.reshape(tl.join(acc_e, acc_o), [BLOCK_G, BLOCK_D])
    else:
        q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
        acc, l_i, m_i = _attend_split(q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_d, d_mask, start, end,
                                      scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_G, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                                      DOT_DTYPE, DOT_PRECISION)
    if KV_FP8:  # the value scale, once per output
        acc = acc * tl.load(kv_scale_ptr + num_kv_heads + kv_head)
    _store_split(acc, l_i, m_i, row, heads, split, offs_d, g_mask, d_mask, out_ptr, part_out_ptr, part_lse_ptr,
                 stride_ot, stride_oh, num_heads, oq_ptr, os_ptr, rows_padded, num_splits, HEAD_DIM, SPLIT, QUANT_OUT,
                 not USE_ASM)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    oq_ptr, os_ptr, rows_padded, QUANT_OUT: tl.constexpr, EMULATE: tl.constexpr,
):
    # One program per (row, query head): weight each split by exp2(lse_s - max lse).
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    part = (row * num_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0.0, den, 1.0)
    if QUANT_OUT:  # one head = one 128-wide group of the o projection's input
        one = tl.arange(0, 1)
        store_heads_quantized(tl.reshape(res, [1, BLOCK_D]), row + one, head + one, one == 0, oq_ptr, os_ptr,
                              rows_padded, num_heads * 128, out_ptr.dtype.element_ty, EMULATE)
    else:
        tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
                 mask=d_mask)


def _tiles(head_dim: int, pairs: bool, block_n: int | None, num_stages: int | None,
           device: torch.device) -> tuple[int, int]:
    """(key-tile size, pipeline stages), each where not given. 128-key tiles, 3 stages: the fastest
    of `kernel-times paged-attention --sweep R 100 L --sweep-heads-first` on an H100 at both 128 rows
    x 100-1,152 keys (123.3 us; 32-key tiles 120.2 there but 137.5 at 64 rows) and 64 rows x
    100-2,048 (109.7 us); wider heads keep the smaller tile (shared memory). An e4m3 pool's pairs: 5
    stages, the first to double-buffer the tiles (the block-table load takes a stage ahead of them):
    -5 % at 32 x 12,288 keys against 3."""
    wide = head_dim > 128
    if block_n is None:
        block_n = 16 if device.type == "cpu" else (64 if wide else 128)
    if num_stages is None:
        num_stages = 5 if pairs else (2 if wide else 3)
    return block_n, num_stages


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    heads_fastest: bool = True,
    kv_scale: torch.Tensor | None = None,
    quantize: bool = False,
) -> torch.Tensor | QuantizedRows:
    """Attention of one query per row (q: [R, H, D], row r = token r) over the row's paged
    KV (already appended). ``meta.max_kv_len`` is not used. Returns [R, H, D] in q's dtype, or
    with ``quantize`` (D = 128) its [R, H * D] rows quantized for an FP8 o projection in the same
    kernel (``QuantizedRows``; the bits of the output then ``quantize_activation``).
    ``kv_scale`` [2, KVH]: an e4m3 cache's key / value scales.

    ``num_splits`` / ``block_n`` / ``num_warps`` / ``num_stages`` override the split count,
    key-tile size and launch settings, ``heads_fastest=False`` puts rows first in the grid (tests,
    ``kernel-times paged-attention --sweep``)."""
    check_cache(kv_cache, q)
    num_rows, num_heads, head_dim = q.shape[0], q.shape[1], q.shape[2]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out, rows_q, quant_args = attention_outputs(q, quantize)
    if num_rows == 0:
        return out if rows_q is None else rows_q
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, num_kv_heads, meta.block_table.shape[1], block_size, q.device)
    scale_ptr, fp8 = kv_scale_args(kv_cache, kv_scale, q)
    pairs = fp8 and q.dtype in (torch.bfloat16, torch.float16)  # fp32 queries keep fp32 dots
    if pairs and head_dim % 2:
        raise ValueError(f"an e4m3 cache needs an even head_dim, got {head_dim}")
    block_n, num_stages = _tiles(head_dim, pairs, block_n, num_stages, q.device)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 on GPU
    if num_splits > 1:
        part_out = torch.empty(num_rows, num_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(num_rows, num_heads, num_splits, device=q.device, dtype=torch.float32)
    else:  # unused by the kernel
        part_out = part_lse = out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if pairs:  # int16 pairs of dims (the strides count pairs)
        k_cache, v_cache = k_cache.view(torch.int16), v_cache.view(torch.int16)
        block_d = max(32, block_d)  # each half a dot of K >= 16
    rows = max(16, triton.next_power_of_2(group))  # BLOCK_G
    _, block_n, num_stages = launch_limits.attention_tiles(
        rows, block_n, block_d, num_stages, num_warps, q.element_size(), kv_cache.element_size(),
        launch_limits.device_limits(q.device), [(rows, n) for n in (64, 32, 16)])
    heads_fastest = heads_fastest and num_rows < 65536  # the grid's 2nd axis holds at most 65,535
    grid = (num_kv_heads, num_rows, num_splits) if heads_fastest else (num_rows, num_kv_heads, num_splits)
    q_arg = q_as_pairs(q) if pairs else q
    _decode_split_kernel[grid](
        q_arg, k_cache, v_cache, meta.block_table, meta.kv_lens, meta.positions,
        meta.kv_lens if meta.row_order is None else meta.row_order,
        out, part_out, part_lse,
        q_arg.stride(0), q_arg.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_table.stride(0),
        num_heads, scale * _LOG2E, scale_ptr, num_kv_heads, KV_FP8=fp8,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n, num_splits=num_splits,
        SPLIT=num_splits > 1, ORDERED=meta.row_order is not None, E4M3_PAIRS=pairs, BLOCK_P=block_d // 2,
        Q_BF16=q.dtype == torch.bfloat16,
        USE_ASM=not emulate(_decode_split_kernel),
        HEADS_FASTEST=heads_fastest, **dot_args(_decode_split_kernel, kv_cache.dtype, q.dtype),
        **quant_args, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_rows, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, BLOCK_D=block_d, **quant_args,
            EMULATE=emulate(_decode_merge_kernel), num_warps=4,
        )
    return out if rows_q is None else rows_q
