"""Varlen causal attention over a paged KV cache for mixed batches (prefill chunks, which
may continue a cached prefix, plus decode rows).

A program owns one tile of up to BLOCK_Q consecutive query tokens of ONE row and all the
query heads of one KV head: its BLOCK_M = BLOCK_Q * BLOCK_G matrix rows are
(token, head-in-group) pairs, so each K/V tile is read once for the whole GQA group and
``tl.dot`` gets >= 16 rows even for a decode row. Key j is visible to a query at
position p when j <= p and j < kv_len (the row's KV starts at position 0).

Row r's tiles take slots ``cu_query_lens[r] // BLOCK_Q + r`` on; this bounds the tile count
by ``num_tokens // BLOCK_Q + num_rows`` without reading any lengths on the host, so the grid
depends only on num_tokens and num_rows (graph-safe, like the decode kernel). Once per step
(``tile_schedule``, shared by every layer) the slots are listed most keys first, each as
(row, first query), and empty slots last: program i runs the i-th, so the longest tiles
start first and the short ones fill the tail. The order changes no bits: each tile's
arithmetic is its own.

Wider tiles, TMA loads over pages of 64+ tokens: ``triton_prefill_wide``'s kernel, picked by the
launch (``triton_prefill_common.prefill_launch``; ``kernel-times prefill-attention`` sweeps both).

An e4m3 cache (``KV_FP8``): as in the decode kernel, the key scale is folded into the softmax
scale and the value scale into the output (see kv_cache_fp8), and with 16-bit queries
(``E4M3_PAIRS``) the pool is read as int16 pairs of neighbouring dims, widened in registers to
float16 even / odd halves (one conversion per two values, where e4m3 -> f16 -> bf16 took two a
value), queries to float16 scaled by a power of two per row, probabilities float16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_async.forward_batch import AttentionMetadata
from megatron_async.kernels import flashinfer_prefill, launch_limits
from megatron_async.kernels.triton_fp8_act import QuantizedRows, attention_outputs
from megatron_async.kernels.triton_fp8_common import emulate
from megatron_async.kernels.triton_paged_common import (
    attend, check_cache, dot_args, kv_scale_args, kv_tile, kv_tile_rows, load_q_pairs, max_registers, q_as_pairs,
    widen_e4m3_pairs,
)
from megatron_async.kernels.triton_prefill_common import (  # noqa: F401 (prefill_fallbacks, NUM_*: the launch's)
    NUM_STAGES, NUM_WARPS, PrefillLaunch, fitted_launch, key_ranges, prefill_fallbacks, prefill_launch, prefill_tiles,
    store_output, tile_queries, unusable,
)
from megatron_async.kernels.triton_prefill_wide import prefill_wide_kernel
from megatron_async.kernels.triton_tile_schedule import tile_schedule

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_e4m3(acc_e, acc_o, l_i, m_i, q_e, q_o, pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_p, p_mask,
                 lo, hi, row_scale, stride_cb, stride_cs, stride_ch,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_P: tl.constexpr,
                 USE_ASM: tl.constexpr):
    """``attend`` over an e4m3 cache read as int16 pairs of neighbouring dims, as the decode kernel
    reads it: each K / V tile widens to float16 even / odd halves (one conversion per two values,
    ``widen_e4m3_pairs``), q.k = q_even.k_even + q_odd.k_odd, and each half of the output its own
    accumulator. ``row_scale``: the softmax scale in log2 units times each row's query scale."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows = kv_tile_rows(table_ptr, n0, hi, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N, MASK)
        kv_ptrs = rows[:, None] + offs_p[None, :]
        k = kv_tile(k_cache_ptr, kv_ptrs, offs_n, hi, p_mask, MASK, EVEN_P, 0)
        k_e, k_o = widen_e4m3_pairs(k, USE_ASM)
        qk = tl.dot(q_o, tl.trans(k_o), tl.dot(q_e, tl.trans(k_e)))
        if MASK:
            qk = tl.where(offs_n[None, :] <= pos[:, None], qk * row_scale[:, None], float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_ij[:, None])
        else:  # row_scale > 0: the scaled row's max is the max times its scale
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * row_scale)
            p = tl.math.exp2(qk * row_scale[:, None] - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = kv_tile(v_cache_ptr, kv_ptrs, offs_n, hi, p_mask, MASK, EVEN_P, 0)
        v_e, v_o = widen_e4m3_pairs(v, USE_ASM)
        p16 = p.to(tl.float16)
        acc_e = tl.dot(p16, v_e, acc_e * alpha[:, None])
        acc_o = tl.dot(p16, v_o, acc_o * alpha[:, None])
        m_i = m_ij
    return acc_e, acc_o, l_i, m_i


@triton.jit
def _tile(q_rows, m_valid, pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, no_mask_end, end, scale_log2,
          stride_cb, stride_cs, stride_ch, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(unnormalised output, softmax sum) of a tile's queries (rows at ``q_rows``) over its keys:
    the unmasked range below every query's position, then the causal one."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=m_valid[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    acc, l_i, m_i = attend(acc, l_i, m_i, q, pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_d, d_mask,
                           0, no_mask_end, scale_log2, stride_cb, stride_cs, stride_ch,
                           BLOCK_SIZE, BLOCK_N, False, EVEN_D, DOT_DTYPE, DOT_PRECISION)
    acc, l_i, m_i = attend(acc, l_i, m_i, q, pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_d, d_mask,
                           no_mask_end, end, scale_log2, stride_cb, stride_cs, stride_ch,
                           BLOCK_SIZE, BLOCK_N, True, EVEN_D, DOT_DTYPE, DOT_PRECISION)
    return acc, l_i


@triton.jit
def _tile_e4m3(q_rows, m_valid, pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, no_mask_end, end, scale_log2,
               stride_cb, stride_cs, stride_ch, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, Q_BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """``_tile`` over an e4m3 cache read as int16 pairs (``_attend_e4m3``): the queries as float16
    even / odd halves scaled per row (``load_q_pairs``), the two output halves interleaved at the end."""
    BLOCK_P: tl.constexpr = BLOCK_D // 2
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < HEAD_DIM // 2
    q_e, q_o, q_up = load_q_pairs(q_rows, m_valid, HEAD_DIM, BLOCK_P, Q_BF16)
    row_scale = q_up * scale_log2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_e = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc_o = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    EVEN_P: tl.constexpr = HEAD_DIM == BLOCK_D
    acc_e, acc_o, l_i, m_i = _attend_e4m3(acc_e, acc_o, l_i, m_i, q_e, q_o, pos, k_cache_ptr, v_cache_ptr, table_ptr,
                                          kv_head, offs_p, p_mask, 0, no_mask_end, row_scale, stride_cb, stride_cs,
                                          stride_ch, BLOCK_SIZE, BLOCK_N, False, EVEN_P, USE_ASM)
    acc_e, acc_o, l_i, m_i = _attend_e4m3(acc_e, acc_o, l_i, m_i, q_e, q_o, pos, k_cache_ptr, v_cache_ptr, table_ptr,
                                          kv_head, offs_p, p_mask, no_mask_end, end, row_scale, stride_cb, stride_cs,
                                          stride_ch, BLOCK_SIZE, BLOCK_N, True, EVEN_P, USE_ASM)
    return tl.reshape(tl.join(acc_e, acc_o), [BLOCK_M, BLOCK_D]), l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_lens_ptr,
    positions_ptr,
    cu_q_ptr,
    schedule_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    scale_log2, kv_scale_ptr, num_kv_heads,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    KV_FP8: tl.constexpr,
    E4M3_PAIRS: tl.constexpr,
    Q_BF16: tl.constexpr,
    USE_ASM: tl.constexpr,
    oq_ptr, os_ptr, rows_padded, QUANT_OUT: tl.constexpr,
):
    if HEADS_FASTEST:  # a tile's KV heads run side by side: they read the same tokens' K/V records
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
    if KV_FP8:  # the key scale folded into the softmax scale (powers of two: exact)
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr + kv_head)
    q_rows = q_ptr + tok * stride_qt + heads * stride_qh
    if E4M3_PAIRS:  # 16-bit queries over an e4m3 cache: float16 halves of even and odd dims
        acc, l_i = _tile_e4m3(q_rows, m_valid, pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, no_mask_end, end,
                              scale_log2, stride_cb, stride_cs, stride_ch, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_SIZE,
                              BLOCK_N, Q_BF16, USE_ASM)
    else:
        acc, l_i = _tile(q_rows, m_valid, pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, no_mask_end, end,
                         scale_log2, stride_cb, stride_cs, stride_ch, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_SIZE, BLOCK_N,
                         DOT_DTYPE, DOT_PRECISION)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:  # the value scale, once per output
        o = o * tl.load(kv_scale_ptr + num_kv_heads + kv_head)
    store_output(o, tok, heads, m_valid, out_ptr, stride_ot, stride_oh, oq_ptr, os_ptr, rows_padded,
                  num_kv_heads * GROUP * 128, HEAD_DIM, BLOCK_D, QUANT_OUT, not USE_ASM)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    block_q: int | None = None,
    block_n: int | None = None,
    fixed_order: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heads_fastest: bool = True,
    maxnreg: int | None = None,
    kv_scale: torch.Tensor | None = None,
    quantize: bool = False,
    launch: PrefillLaunch | None = None,
    flashinfer_rows: bool = False,
) -> torch.Tensor | QuantizedRows:
    """Causal attention of packed queries q [T, H, D] (rows as in ``meta``) over each row's paged KV
    (already appended). Returns [T, H, D] in q's dtype, or with ``quantize`` (D = 128, not with
    ``fixed_order``) its [T, H * D] rows quantized for an FP8 o projection in the same kernel.
    ``launch``: tiles, warps, stages, register cap and kernel variant (default ``prefill_launch``, the
    long-row one where ``meta.long_tiles``; an explicit one its kernel cannot run raises ValueError,
    the default falls back to the pointer kernel's). ``block_q`` / ``block_n`` / ``num_warps`` /
    ``num_stages`` / ``maxnreg`` override its tiles and launch settings (tests, sweeps). ``fixed_order``:
    the batch-invariant kernel instead (``triton_invariant_attention``; no tile arguments).
    ``heads_fastest``: the grid's first axis is the KV head, so the programs of one query tile start
    together (7 % faster on a mixed step: a token's heads share one cache record; ``kernel-times
    paged-attention --grid-order``); same bits. ``kv_scale`` [2, KVH]: an e4m3 cache's scales.
    ``flashinfer_rows``: in a long-tile step of a 16-bit cache, rows of ``flashinfer_prefill.MIN_QUERY``+
    tokens run FlashInfer's FA3 kernel, one-token rows the decode kernel, the others this one."""
    if fixed_order:
        return _invariant(q, kv_cache, meta, scale, kv_scale, quantize)
    check_cache(kv_cache, q)
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out, rows_q, quant_args = attention_outputs(q, quantize)
    if num_tokens == 0 or meta.num_rows == 0:
        return out if rows_q is None else rows_q
    group = num_heads // num_kv_heads
    block_g = max(1, triton.next_power_of_2(group))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    scale_ptr, fp8 = kv_scale_args(kv_cache, kv_scale, q)
    pairs = fp8 and q.dtype in (torch.bfloat16, torch.float16)  # fp32 queries keep fp32 dots
    launch = _chosen_launch(launch, group, head_dim, block_size, fp8, q.device, meta.long_tiles)
    launch = _overridden(launch, block_q * block_g if block_q else None, block_n, num_warps, num_stages, maxnreg)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 on GPU
    if pairs:  # int16 pairs of dims (the strides count pairs)
        if head_dim % 2:
            raise ValueError(f"an e4m3 cache needs an even head_dim, got {head_dim}")
        k_cache, v_cache = k_cache.view(torch.int16), v_cache.view(torch.int16)
        block_d = max(32, block_d)  # each half a dot of K >= 16
    launch = fitted_launch(launch, block_g, block_d, q.element_size(), kv_cache.element_size(),
                           launch_limits.device_limits(q.device))
    block_q = launch.rows // block_g
    q_arg = q_as_pairs(q) if pairs else q
    tiles = num_tokens // block_q + meta.num_rows
    schedule = _hand_off_rows(q, kv_cache, meta, scale, out, block_q, tiles,
                              flashinfer_rows and meta.long_tiles and not fp8 and rows_q is None)
    heads_fastest = heads_fastest and tiles < 65536  # the grid's 2nd axis holds at most 65,535
    grid = (num_kv_heads, tiles) if heads_fastest else (tiles, num_kv_heads)
    settings = dict(num_warps=launch.num_warps, num_stages=launch.num_stages,
                    **({"maxnreg": launch.maxnreg} if launch.maxnreg else {}))
    if launch.kernel != "pointer":
        _launch_wide(q, kv_cache, meta, schedule, out, grid, launch, scale, group, block_q, heads_fastest, quant_args,
                     settings)
        return out if rows_q is None else rows_q
    _prefill_kernel[grid](
        q_arg, k_cache, v_cache, meta.block_table, meta.kv_lens, meta.positions, meta.cu_query_lens, schedule, out,
        q_arg.stride(0), q_arg.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_table.stride(0),
        scale * _LOG2E, scale_ptr, num_kv_heads,
        GROUP=group, BLOCK_G=block_g, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=launch.block_n,
        **dot_args(_prefill_kernel, kv_cache.dtype, q.dtype), HEADS_FASTEST=heads_fastest, KV_FP8=fp8,
        E4M3_PAIRS=pairs, Q_BF16=q.dtype == torch.bfloat16,
        USE_ASM=not emulate(_prefill_kernel), **quant_args, **settings,
    )
    return out if rows_q is None else rows_q


def _invariant(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               kv_scale: torch.Tensor | None, quantize: bool) -> torch.Tensor:
    """``fixed_order``: the batch-invariant kernel, whose output is never quantized."""
    if quantize:
        raise ValueError("prefill_attention: the batch-invariant kernel returns its output unquantized")
    from megatron_async.kernels.triton_invariant_attention import invariant_attention

    return invariant_attention(q, kv_cache, meta, scale, kv_scale=kv_scale)


def _hand_off_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                   out: torch.Tensor, block_q: int, tiles: int, split: bool) -> torch.Tensor:
    """The tile schedule of the rows this kernel runs: all, or with ``split`` those of 2 to
    ``MIN_QUERY`` - 1 tokens, after it has run the longer ones on FA3 and the one-token rows on the
    decode kernel (into ``out``)."""
    if not split:
        return tile_schedule(meta, block_q, tiles)
    flashinfer_prefill.attend_long_rows(q, kv_cache, meta, scale, out)
    flashinfer_prefill.attend_decode_rows(q, kv_cache, meta, scale, out)
    return tile_schedule(meta, block_q, tiles, min_query=2, max_query=flashinfer_prefill.MIN_QUERY - 1)


def _launch_wide(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, schedule: torch.Tensor,
                 out: torch.Tensor, grid: tuple[int, int], launch: PrefillLaunch, scale: float, group: int,
                 block_q: int, heads_fastest: bool, quant_args: dict, settings: dict) -> None:
    """``prefill_wide_kernel`` on a launch of the "wide" or "tma" kernel (16-bit caches)."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    descs = kv_descriptors(kv_cache, launch.block_n) if launch.kernel == "tma" else (k_cache, v_cache)
    prefill_wide_kernel[grid](
        q, k_cache, v_cache, *descs, meta.block_table, meta.kv_lens, meta.positions, meta.cu_query_lens,
        schedule, out, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_table.stride(0),
        scale * _LOG2E, num_kv_heads, GROUP=group, BLOCK_G=max(1, triton.next_power_of_2(group)), BLOCK_Q=block_q,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=launch.block_n,
        **dot_args(prefill_wide_kernel, kv_cache.dtype), HEADS_FASTEST=heads_fastest, KV_TMA=launch.kernel == "tma",
        WARP_SPEC=launch.warp_specialize, **quant_args, EMULATE=emulate(prefill_wide_kernel), **settings)


def _overridden(launch: PrefillLaunch, rows: int | None, block_n: int | None, num_warps: int | None,
                num_stages: int | None, maxnreg: int | None) -> PrefillLaunch:
    """``launch`` with the settings a caller gave (None: the launch's own)."""
    return launch._replace(rows=rows or launch.rows, block_n=block_n or launch.block_n,
                           num_warps=num_warps or launch.num_warps, num_stages=num_stages or launch.num_stages,
                           maxnreg=launch.maxnreg if maxnreg is None else maxnreg)


def _chosen_launch(launch: PrefillLaunch | None, group: int, head_dim: int, block_size: int, fp8: bool,
                   device: torch.device, long: bool = False) -> PrefillLaunch:
    """An explicit ``launch`` (ValueError where its kernel cannot run this call), else the step's one
    (``long``: ``AttentionMetadata.long_tiles``), or the pointer kernel's where that cannot run."""
    if launch is not None:
        why = unusable(launch, head_dim, block_size, fp8)
        if why:
            raise ValueError(why)
        return launch
    launch = prefill_launch(group, head_dim, block_size, device, long)
    if unusable(launch, head_dim, block_size, fp8):
        block_q, block_n = prefill_tiles(group, device)
        launch = PrefillLaunch(block_q * max(1, triton.next_power_of_2(group)), block_n, NUM_WARPS, NUM_STAGES,
                               max_registers(head_dim, device) or 0)
    return launch


def kv_descriptors(kv_cache: torch.Tensor, block_n: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of a layer's K and V caches, each viewed as [num_blocks * block_size,
    kv_heads * head_dim] (a token's heads side by side), loading [block_n, head_dim] tiles."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads * head_dim)
    return tuple(TensorDescriptor.from_tensor(flat[i], [block_n, head_dim]) for i in range(2))
