"""Hopper-sized variants of the prefill kernel (``triton_prefill_attention``): the same tiles of
(token, head-in-group) rows, schedule, key ranges and output, with the key loop written for wide
tiles (128 rows x 64-128 keys on 8 warps, no register cap), where ``tl.dot`` maps to wgmma with N
of 64-128 instead of 32. 16-bit caches only (an e4m3 pool keeps the pointer kernel).

Two ways to read K / V:
- pointers through the block table, one table entry a key (``kv_tile_rows``; any page size), as the
  pointer kernel does, software-pipelined by the compiler (cp.async);
- (``KV_TMA``) TMA descriptors over a layer's cache viewed as [num_blocks * block_size, kv_heads * head_dim]: one
  table read and one bulk copy a tile, which needs a tile inside one page (pages of at least
  BLOCK_N tokens: 64 / 128-token pages, ``block_size_tokens``). A tile on the diagonal may run past
  the row's last key into the rest of its page: those rows of V are zeroed (they may hold anything,
  NaN included, and 0 x NaN is NaN), their scores masked as on the pointer path.

``WARP_SPEC`` asks the compiler to warp-specialize the unmasked loop (loads in a producer warp,
``tl.range(warp_specialize=True)``); where the installed Triton cannot on this device the launch
fails and a sweep marks it."""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_async.kernels.triton_paged_common import kv_tile, kv_tile_rows, softmax_step
from megatron_async.kernels.triton_prefill_common import key_ranges, store_output, tile_queries


@triton.jit
def _attend_wide(acc, l_i, m_i, q, pos, k_cache_ptr, v_cache_ptr, k_desc, v_desc, table_ptr, kv_head, lo, hi,
                 qk_scale, stride_cb, stride_cs, stride_ch, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASK: tl.constexpr, KV_TMA: tl.constexpr,
                 WARP_SPEC: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``attend`` (the online softmax in log2 units, the scale folded into the max subtraction) with
    the K / V tile read by descriptor (``KV_TMA``) or through pointers."""
    offs_d = tl.arange(0, HEAD_DIM)
    d_all = offs_d < HEAD_DIM
    for n0 in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if KV_TMA:  # the tile lies inside one page: one table entry, one bulk copy each for K and V
            block = tl.load(table_ptr + n0 // BLOCK_SIZE)
            first = block * BLOCK_SIZE + n0 % BLOCK_SIZE
            k = k_desc.load([first, kv_head * HEAD_DIM])
        else:
            rows = kv_tile_rows(table_ptr, n0, hi, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N,
                                MASK)
            kv_ptrs = rows[:, None] + offs_d[None, :]
            k = kv_tile(k_cache_ptr, kv_ptrs, offs_n, hi, d_all, MASK, True, 0.0)
        qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        p, acc, l_i, m_ij = softmax_step(qk, acc, l_i, m_i, offs_n, pos, qk_scale, MASK)
        if KV_TMA:
            v = v_desc.load([first, kv_head * HEAD_DIM])
            if MASK:  # the page's slots past the row's keys: any bits
                v = tl.where((offs_n < hi)[:, None], v, 0.0)
        else:
            v = kv_tile(v_cache_ptr, kv_ptrs, offs_n, hi, d_all, MASK, True, 0.0)
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def prefill_wide_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_table_ptr, kv_lens_ptr, positions_ptr, cu_q_ptr,
    schedule_ptr, out_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    scale_log2, num_kv_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEADS_FASTEST: tl.constexpr, KV_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
    oq_ptr, os_ptr, rows_padded, QUANT_OUT: tl.constexpr, EMULATE: tl.constexpr,
):
    if HEADS_FASTEST:
        kv_head = tl.program_id(0)
        tile = tl.program_id(1)
    else:
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
    entry = tl.load(schedule_ptr + tile)
    if entry < 0:  # an empty slot (the schedule lists them last)
        return
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    row, tok, heads, m_valid, pos = tile_queries(entry, kv_head, cu_q_ptr, positions_ptr, GROUP, BLOCK_G, BLOCK_Q)
    kv_len = tl.load(kv_lens_ptr + row)
    no_mask_end, end = key_ranges(kv_len, pos, m_valid, BLOCK_N)
    table_ptr = block_table_ptr + row.to(tl.int64) * stride_bt

    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + tok * stride_qt + heads * stride_qh
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=m_valid[:, None], other=0.0).to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, l_i, m_i = _attend_wide(acc, l_i, m_i, q, pos, k_cache_ptr, v_cache_ptr, k_desc, v_desc, table_ptr, kv_head,
                                 0, no_mask_end, scale_log2, stride_cb, stride_cs, stride_ch, HEAD_DIM, BLOCK_SIZE,
                                 BLOCK_N, False, KV_TMA, WARP_SPEC, DOT_DTYPE, DOT_PRECISION)
    acc, l_i, m_i = _attend_wide(acc, l_i, m_i, q, pos, k_cache_ptr, v_cache_ptr, k_desc, v_desc, table_ptr, kv_head,
                                 no_mask_end, end, scale_log2, stride_cb, stride_cs, stride_ch, HEAD_DIM, BLOCK_SIZE,
                                 BLOCK_N, True, KV_TMA, False, DOT_DTYPE, DOT_PRECISION)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    store_output(o, tok, heads, m_valid, out_ptr, stride_ot, stride_oh, oq_ptr, os_ptr, rows_padded,
                 num_kv_heads * GROUP * 128, HEAD_DIM, HEAD_DIM, QUANT_OUT, EMULATE)
