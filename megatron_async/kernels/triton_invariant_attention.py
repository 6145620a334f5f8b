"""Batch-invariant attention over a paged KV cache: every query, decode token or prefill chunk
token, gets bits that depend only on its position and the K/V it reads, never on the step's
other rows, on how its prompt was chunked, or on decode vs prefill.

Split-KV with split boundaries in absolute key positions. A query at position p sees keys
[0, L), L = min(p + 1, kv_len); they fall into ``n = cdiv(L, S)`` splits [s S, (s + 1) S)
of the fixed size S (``split_size``: a function of the block table's width only). For each
split the query gets the fp32 online softmax of its keys, walked from s S in BLOCK_N tiles in
key order, normalised to (o_s, lse_s). Tiles below every query of the program's tile run
without the causal mask, the rest with it (a tile wholly invisible to a query is an exact
no-op for it: alpha 1, p 0); where that line falls depends on the tile's other queries, so
the kernel is compiled without FMA contraction (``enable_fp_fusion=False``): the masked
update's select would otherwise keep the scaled score out of the FMA the unmasked one forms
(sm_90 SASS: 18 FFMA per unmasked tile with contraction, none without), and a key tile gives
a query the same bits in either loop. With n == 1 the query's output is o_0; otherwise a
second kernel merges o_0 .. o_{n-1} in split order. Neither the partials nor the merge depend
on the batch: a long decode row is cut into the same splits
as the prefill tokens of a long prompt, and every split is its own program, so a decode
step of a few long rows still fills the device (flash-decoding, with the splits fixed in
absolute positions as batch-invariant modes elsewhere fix them).

A program owns (KV head, query tile, split); a query tile is up to BLOCK_Q consecutive tokens
of ONE row (the prefill kernel's tile schedule, most keys first) x the GQA group: 64 matrix
rows on GPU, the default prefill kernel's tile, key loop (``attend``) and register cap
(tensor-core wgmma; one compiled kernel for every query, decode or prefill, so a query's
arithmetic is the same in any step and any slot of its tile). A query that sees no key of a
split (its position below the split's start) gets NaN there and is never stored. A decode row
fills one matrix row per head of its tile: the wasted rows cost MMA work, not memory, and a
split's keys stream at the copy rate (32 keys x 64 rows x 128 is ~256 tensor-core cycles of an
SM against ~1,200 to bring the tile's 16 KB in at its share of the H100's bandwidth).

Launch grids depend only on num_tokens, num_rows and the block table's width (graph-safe).
An e4m3 cache (``KV_FP8``): the key scale is folded into the softmax scale, the value scale
multiplies each split's output (see kv_cache_fp8). Runs on CPU under TRITON_INTERPRET=1."""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from megatron_async.forward_batch import AttentionMetadata
from megatron_async.kernels import launch_limits
from megatron_async.kernels.triton_paged_common import (
    CAPPED_HEAD_DIM, attend, check_cache, dot_args, kv_scale_args, max_registers,
)
from megatron_async.kernels.triton_tile_schedule import tile_schedule

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 8
"""The split size doubles until a full-width row has at most this many splits (bounds the
partials' workspace: num_tokens x splits x heads x head_dim float32)."""


def split_size(max_keys: int, device: torch.device) -> int:
    """Keys per split for rows of at most ``max_keys`` (the block table's width x block size):
    4,096 on GPU (32 on CPU, so tiny tests cross splits), doubled until a full row has <= 8
    splits. A function of the engine's table only, never of a step."""
    size = 32 if device.type == "cpu" else 4096
    while triton.cdiv(max_keys, size) > _MAX_SPLITS:
        size *= 2
    return size


LONG_KEY_TILE_KEYS = 8192
"""Block tables of this many keys or more (long-context engines) walk 64-key tiles, shorter ones 32:
on an H200 (``kernel-times invariant-kernels --sweep --long``, us a layer) a prefill step of 8,192
tokens after 4-12k keys ran 1,527 in 128 x 64 tiles against 1,758 in 64 x 32, and 32 decode rows
of 8-16k keys 497 either way, but short rows lose (a workload-A-shaped mixed step 157 against 132,
a decode step of 100-1,152 keys 100 against 91). The key tile is a summation order, so like the
split size it is a function of the table alone."""


def tiles(group: int, device: torch.device, max_keys: int = 0) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N): query tokens per tile (64 matrix rows on GPU, 16 on CPU so tiny tests
    cross tiles) and keys per K/V tile (on GPU 32, the default prefill kernel's choice, or 64 in a
    table of ``LONG_KEY_TILE_KEYS``+ keys; 16 on CPU)."""
    block_g = max(1, triton.next_power_of_2(group))
    block_n = 16 if device.type == "cpu" else 64 if max_keys >= LONG_KEY_TILE_KEYS else 32
    return max(1, (16 if device.type == "cpu" else 64) // block_g), block_n


def splits_long_steps(device: torch.device, max_keys: int) -> bool:
    """Whether a long-tile step runs its long rows in a launch of larger tiles (``launches``): 64-key
    tables on GPU; always on CPU (tests). Elsewhere such a step gains nothing from the tile class."""
    return device.type == "cpu" or tiles(1, device, max_keys)[1] > 32


@dataclasses.dataclass(frozen=True)
class _Launch:
    """One launch of the split kernel: matrix rows a tile, warps, register cap (0: the compiler's),
    and the rows it takes (query tokens ``min_query`` .. ``max_query``)."""
    rows: int
    num_warps: int
    maxnreg: int
    min_query: int = 0
    max_query: int = 2**31 - 1


def launches(meta: AttentionMetadata, group: int, block_n: int, head_dim: int, device: torch.device) -> list[_Launch]:
    """The step's launches. A tile's rows and warps change which program computes a query, never
    its bits (``kernel-times invariant-kernels --sweep`` compares them bit for bit: 64 and 128
    rows, 4 and 8 warps, any cap; 16 and 32 rows, other MMA instructions, do not), so a long-tile step (``meta.long_tiles``) of a 64-key table runs its rows that fill a
    128-row tile in such tiles (8 warps, 128 registers: 1,527 against 1,758 us above) and its
    other rows, decode rows among them, in 64-row tiles (128-row tiles ran 32 long decode rows
    627 us against 497). Other steps run every row in one launch of 64-row tiles: capped at 128
    registers with 32-key tiles, the compiler's choice with 64 (decode 497 against 589 us)."""
    cpu = device.type == "cpu"
    small = _Launch(16 if cpu else 64, 4, 0 if cpu or block_n > 32 else max_registers(head_dim, device) or 0)
    if not (meta.long_tiles and (cpu or block_n > 32)) or head_dim > CAPPED_HEAD_DIM:  # (block_n > 32:
        return [small]  # a table splits_long_steps takes; the big tiles hold 128 registers)
    big = _Launch(32 if cpu else 128, 8, 0 if cpu else 128)
    fills = max(1, big.rows // max(1, triton.next_power_of_2(group)))  # query tokens of one big tile
    return [dataclasses.replace(big, min_query=fills), dataclasses.replace(small, max_query=fills - 1)]


@triton.jit
def _rows(q_begin, q_len, first, kv_head, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The tile's matrix rows (tokens first .. first + BLOCK_Q - 1 of the row x the group's heads):
    (token ids, head ids, valid)."""
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_idx = first + offs_m // BLOCK_G
    g = offs_m % BLOCK_G
    return (q_begin + q_idx).to(tl.int64), kv_head * GROUP + g, (q_idx < q_len) & (g < GROUP)


@triton.jit
def _finish(acc, l_i, m_i, split, pos, kv_len, tok, heads, valid, offs_d, d_mask, vscale, out_ptr, part_ptr,
            lse_ptr, stride_ot, stride_oh, num_heads, SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr,
            HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr):
    """The tile's split result: the output itself for queries with one split, else the partial
    (o, lse) at [token, split, head] for the merge (queries that see none of this split: nothing)."""
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * vscale
    splits = tl.cdiv(tl.minimum(pos + 1, kv_len), SPLIT)
    mask2 = d_mask[None, :]
    alone = valid & (splits + split <= 1)  # split 0 only (a query without keys: 0 from any split)
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=alone[:, None] & mask2)
    if MAX_SPLITS > 1:  # (one split: short tables, e.g. workload A's, compile no partial stores)
        part = valid & (splits > 1) & (split < splits)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        slot = (tok * MAX_SPLITS + split) * num_heads + heads
        tl.store(lse_ptr + slot, lse, mask=part)
        tl.store(part_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], o, mask=part[:, None] & mask2)


@triton.jit
def _split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_lens_ptr, positions_ptr, cu_q_ptr, schedule_ptr,
    out_ptr, part_ptr, lse_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
    stride_bt, num_heads, scale_log2, kv_scale_ptr, num_kv_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    MAX_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
):
    if HEADS_FASTEST:  # a tile's KV heads run side by side: they read the same tokens' K/V records
        kv_head, tile = tl.program_id(0), tl.program_id(1)
    else:
        tile, kv_head = tl.program_id(0), tl.program_id(1)
    split = tl.program_id(2)
    entry = tl.load(schedule_ptr + tile)
    if entry < 0:  # an empty slot (the schedule lists them last)
        return
    row = (entry >> 32).to(tl.int32)
    first = (entry & 0x7FFFFFFF).to(tl.int32)  # first query of the tile, within the row
    q_begin = tl.load(cu_q_ptr + row)
    q_len = tl.load(cu_q_ptr + row + 1) - q_begin
    kv_len = tl.load(kv_lens_ptr + row)  # int32 like positions: the key loops as the prefill kernel runs them
    tok, heads, valid = _rows(q_begin, q_len, first, kv_head, GROUP, BLOCK_G, BLOCK_Q)
    pos = tl.load(positions_ptr + tok, mask=valid, other=-1).to(tl.int32)
    lo = split * SPLIT
    hi = tl.minimum(tl.minimum(kv_len, tl.max(pos, 0) + 1), lo + SPLIT)
    if lo >= hi:  # the tile's queries see no key of this split
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
    table_ptr = block_table_ptr + row.to(tl.int64) * stride_bt
    if KV_FP8:  # the key scale folded into the softmax scale (powers of two: exact)
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr + kv_head)
    vscale = 1.0
    if KV_FP8:  # the value scale, applied to each split's output
        vscale = tl.load(kv_scale_ptr + num_kv_heads + kv_head)
    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    # Keys below every query's position need no mask (whole tiles from the split's start); the
    # rest get it. Which of the two loops takes a key tile depends on the tile's other queries,
    # so both must give a query the same bits: the kernel is built without FMA contraction (the
    # masked loop's select would otherwise keep the scaled score out of an FMA the other forms).
    lowest = tl.min(tl.where(valid, pos, kv_len), 0)
    free_end = tl.maximum(lo, tl.minimum(tl.minimum(kv_len, lowest + 1), hi)) // BLOCK_N * BLOCK_N  # (provably whole tiles: one load predicate per tile)
    even_d: tl.constexpr = HEAD_DIM == BLOCK_D
    acc, l_i, m_i = attend(acc, l_i, m_i, q, pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_d, d_mask, lo,
                           free_end, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N, False, even_d,
                           DOT_DTYPE, DOT_PRECISION)
    acc, l_i, m_i = attend(acc, l_i, m_i, q, pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_d, d_mask,
                           free_end, hi, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N, True, even_d,
                           DOT_DTYPE, DOT_PRECISION)
    _finish(acc, l_i, m_i, split, pos, kv_len, tok, heads, valid, offs_d, d_mask, vscale, out_ptr, part_ptr, lse_ptr,
            stride_ot, stride_oh, num_heads, SPLIT, MAX_SPLITS, HEAD_DIM, KV_FP8)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, positions_ptr, kv_lens_ptr, token_to_row_ptr, stride_ot, stride_oh,
                  num_heads, SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token with more than one split: its splits' outputs weighted by
    exp2(lse_s - max lse), added in split order (a loop over exactly its splits)."""
    tok = tl.program_id(0).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + tl.load(token_to_row_ptr + tok)).to(tl.int64)
    splits = tl.cdiv(tl.minimum(tl.load(positions_ptr + tok).to(tl.int64) + 1, kv_len), SPLIT)
    if splits <= 1:  # written by the split kernel
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_heads
    mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    base = tok * MAX_SPLITS * num_heads + offs_h
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(0, splits):
        m = tl.maximum(m, tl.load(lse_ptr + base + s * num_heads, mask=h_mask, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    for s in range(0, splits):
        w = tl.exp2(tl.load(lse_ptr + base + s * num_heads, mask=h_mask, other=float("-inf")) - m)
        o = tl.load(part_ptr + (base + s * num_heads)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
        acc += w[:, None] * o
        den += w
    res = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=mask)


def invariant_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        kv_scale: torch.Tensor | None = None, split: int | None = None,
                        heads_fastest: bool = True, block_n: int | None = None, maxnreg: int | None = None,
                        num_stages: int = 2, tile_rows: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Causal attention of packed queries q [T, H, D] (rows as in ``meta``) over each row's paged KV
    (already appended), batch-invariant (module docstring). Returns [T, H, D] in q's dtype.
    ``kv_scale`` [2, KVH]: an e4m3 cache's key / value scales. ``split``: keys per split (tests;
    a multiple of the key tile), else ``split_size`` of the block table. ``heads_fastest``: KV heads on
    the grid's first axis (forced off past 65,535 query tiles; tests); same bits either way.
    The launches are ``launches``'; sweeps override them with one launch of ``tile_rows`` matrix
    rows a tile, ``num_warps``, ``maxnreg`` (0: the compiler's choice) and ``num_stages`` (same
    bits). ``block_n``: keys per tile (sweeps only: another key tile is another summation order)."""
    check_cache(kv_cache, q)
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or meta.num_rows == 0:
        return out
    group = num_heads // num_kv_heads
    max_keys = meta.block_table.shape[1] * block_size
    block_q, tile_n = tiles(group, q.device, max_keys)
    block_n = block_n or tile_n
    split = split or split_size(max_keys, q.device)
    if split % block_n:
        raise ValueError(f"split size {split} is not a multiple of the key tile {block_n}")
    plan = launches(meta, group, block_n, head_dim, q.device)
    if tile_rows or maxnreg is not None:
        cap = (max_registers(head_dim, q.device) or 0) if maxnreg is None else maxnreg
        plan = [_Launch(tile_rows or block_q * max(1, triton.next_power_of_2(group)), num_warps, cap)]
    max_splits = triton.cdiv(max_keys, split)
    if max_splits > 1:
        part = torch.empty(num_tokens, max_splits, num_heads, head_dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(num_tokens, max_splits, num_heads, device=q.device, dtype=torch.float32)
    else:  # every query has one split: never written
        part = lse = out
    for launch in plan:
        _launch_splits(q, kv_cache, meta, scale, kv_scale, out, part, lse, launch, block_n, split, max_splits,
                       num_stages, heads_fastest)
    if max_splits > 1:
        block_d = max(16, triton.next_power_of_2(head_dim))
        _merge_kernel[(num_tokens,)](
            part, lse, out, meta.positions, meta.kv_lens, meta.token_to_row, out.stride(0), out.stride(1),
            num_heads, SPLIT=split, MAX_SPLITS=max_splits, BLOCK_H=triton.next_power_of_2(num_heads),
            HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=4,
        )
    return out


def _launch_splits(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                   kv_scale: torch.Tensor | None, out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor,
                   launch: _Launch, block_n: int, split: int, max_splits: int, num_stages: int,
                   heads_fastest: bool) -> None:
    """One launch of the split kernel over the rows ``launch`` takes."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    block_g = max(1, triton.next_power_of_2(group))
    block_q = max(1, launch.rows // block_g)
    slots = num_tokens // block_q + meta.num_rows
    schedule = tile_schedule(meta, block_q, slots, launch.min_query, launch.max_query)
    if launch.max_query < num_tokens:  # short rows only, a few tiles each (live tiles come first)
        slots = min(slots, meta.num_rows * triton.cdiv(launch.max_query, block_q))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    scale_ptr, fp8 = kv_scale_args(kv_cache, kv_scale, q)
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_stages = launch_limits.attention_tiles(  # the key tile fixes the summation order: stages alone
        block_q * block_g, block_n, block_d, num_stages, launch.num_warps, q.element_size(),
        kv_cache.element_size(), launch_limits.device_limits(q.device)).num_stages
    heads_fastest = heads_fastest and slots < 65536  # the grid's 2nd axis holds at most 65,535
    grid = (num_kv_heads, slots, max_splits) if heads_fastest else (slots, num_kv_heads, max_splits)
    _split_kernel[grid](
        q, k_cache, v_cache, meta.block_table, meta.kv_lens, meta.positions, meta.cu_query_lens, schedule,
        out, part, lse, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_table.stride(0),
        num_heads, scale * _LOG2E, scale_ptr, num_kv_heads,
        GROUP=group, BLOCK_G=block_g, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split, MAX_SPLITS=max_splits,
        **dot_args(_split_kernel, kv_cache.dtype, q.dtype), KV_FP8=fp8, HEADS_FASTEST=heads_fastest,
        num_warps=launch.num_warps, num_stages=num_stages, enable_fp_fusion=False,
        **({"maxnreg": launch.maxnreg} if launch.maxnreg else {}),
    )
