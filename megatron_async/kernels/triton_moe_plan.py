"""The row plan of the grouped-GEMM MoE (``moe_grouped_mm.plan_rows``) in two kernels, and the
gather of x's rows in its order. The plan's torch form is ~30 small kernels (a sort, searches,
scatters), ~0.2 ms of a Qwen3-30B-A3B layer at 8,192 tokens with its launch gaps.

A segment of SEG ids is cut into SLICES slices of WIDTH = SEG / SLICES ids (one per warp).
1. ``_count_kernel``, one program per segment: each slice's histogram of experts (ids outside
   [0, E) in bin E) into ``slice_counts`` [segments, SLICES, BINS], their sum into ``counts``
   [segments, BINS] (no atomics).
2. ``_place_kernel``, one program per segment, all experts at once: the column sums of
   ``counts`` give every expert's total (hence its padded rows and where its group starts) and
   its pairs in earlier segments; ``slice_counts`` its pairs in earlier slices of the segment.
   Each slice's keys ``expert * WIDTH + position`` (unique), sorted in the registers and lanes
   of the slice's warp (no exchange between warps while WIDTH <= 128), list the slice's pairs
   by expert and, within one, in pair order: sorted position minus the expert's first position
   in the slice is the pair's rank there. Each pair's row, the token each row reads; program 0
   also writes the offsets and the padding rows, every program a part of the rows past the
   last group.
Graph-safe: grids and bounds come from shapes. Work per pair is a sort of WIDTH keys
(log^2 compare-swaps in registers and lanes) plus a read of the segments x BINS counts per
program."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PROGRAMS = 32  # segments the plan aims for (H100, 4 warps: 9.8 / 11.0 / 13.8 us at 4,096 / 16,384 / 65,536 pairs)
MIN_SEG, MAX_SEG = 128, 512  # up to 128 keys per slice of 4: one warp's 32 lanes x 4


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, slice_counts_ptr, n, E: tl.constexpr, BINS: tl.constexpr,
                  SEG: tl.constexpr, SLICES: tl.constexpr):
    s = tl.program_id(0)
    local = tl.arange(0, SEG)
    offs = s * SEG + local
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=E)
    expert = tl.where((ids >= 0) & (ids < E), ids, E)
    hist = tl.histogram(local // (SEG // SLICES) * BINS + expert, SLICES * BINS)  # [slice, expert], flat
    tl.store(slice_counts_ptr + s * SLICES * BINS + tl.arange(0, SLICES * BINS), hist)
    tl.store(counts_ptr + s * BINS + tl.arange(0, BINS), tl.sum(tl.reshape(hist, [SLICES, BINS]), axis=0))


@triton.jit
def _axis_indicator(LOG: tl.constexpr, d: tl.constexpr):
    """0 / 1: a key's bit d of position, shaped to broadcast over the [slices] + [2] * LOG hypercube."""
    return tl.reshape(tl.arange(0, 2), [1] + [1] * (LOG - d - 1) + [2] + [1] * d)


@triton.jit
def _sort_slices(keys, LOG: tl.constexpr):
    """``keys`` [slices, 2**LOG] (distinct within a slice, in [0, 2**30)), each slice ascending: a
    bitonic sort over each slice viewed as a [2] * LOG hypercube, as ``tl.sort``, but each
    compare-swap finds its partner as the pair's sum minus itself: the same one reduction over a
    size-2 axis on the device, and numpy's sum in Triton's interpreter (``tl.sort``'s XOR
    reduction runs element by element there: minutes)."""
    h = tl.reshape(keys, [keys.shape[0]] + [2] * LOG)
    for stage in tl.static_range(1, LOG + 1):
        for i in tl.static_range(stage):  # compares position bit stage - 1 - i (inline: a constexpr)
            partner = tl.sum(h, axis=1 + LOG - stage + i, keep_dims=True) - h
            right = _axis_indicator(LOG, stage - 1 - i)
            if stage < LOG:  # alternate directions make bitonic runs of 2**(stage + 1)
                right = right ^ _axis_indicator(LOG, stage)
            h = tl.where((h > partner) != (right > 0), partner, h)
    return tl.reshape(h, keys.shape)


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, slice_counts_ptr, row_of_pair_ptr, token_of_row_ptr, offs_ptr,
                  block_expert_ptr, n, P, num_segs, num_blocks, E: tl.constexpr, BINS: tl.constexpr,
                  TOP_K: tl.constexpr, ALIGN: tl.constexpr, SEG: tl.constexpr, SLICES: tl.constexpr,
                  LOG_WIDTH: tl.constexpr, TABLE_ROWS: tl.constexpr, PAIRS: tl.constexpr, BLOCKS_PER: tl.constexpr):
    WIDTH: tl.constexpr = SEG // SLICES
    s = tl.program_id(0)
    experts = tl.arange(0, BINS)
    totals = tl.zeros((TABLE_ROWS, BINS), dtype=tl.int32)
    before = tl.zeros((TABLE_ROWS, BINS), dtype=tl.int32)  # each expert's pairs in segments before s
    for t in range(0, num_segs, TABLE_ROWS):  # summed across segments once, after the loop
        segs = t + tl.arange(0, TABLE_ROWS)
        table = tl.load(counts_ptr + segs[:, None] * BINS + experts[None, :], mask=segs[:, None] < num_segs, other=0)
        totals += table
        before += tl.where(segs[:, None] < s, table, 0)
    totals = tl.sum(totals, axis=0)
    before = tl.sum(before, axis=0)
    # each expert's rows: its pairs rounded up to ALIGN; at least ALIGN (no empty group) unless PAIRS
    rows = tl.where(experts < E, (tl.maximum(totals, 1 - PAIRS) + ALIGN - 1) // ALIGN * ALIGN, 0)
    ends = tl.cumsum(rows, axis=0)
    starts = ends - rows
    # sorted position j of slice l, expert e -> starts[e] + before[e] + (pairs of e in slices
    # before l) + (j - first position of e in slice l)
    sl = tl.arange(0, SLICES)[:, None]
    mine = tl.load(slice_counts_ptr + (s * SLICES + sl) * BINS + experts[None, :])
    shift = (starts + before)[None, :] + (tl.cumsum(mine, axis=0) - mine) - (tl.cumsum(mine, axis=1) - mine)

    j = tl.arange(0, WIDTH)[None, :]
    offs = s * SEG + sl * WIDTH + j
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=E)
    expert = tl.where((ids >= 0) & (ids < E), ids, E)  # E: no expert, and past n (sorted last)
    key = _sort_slices(expert * WIDTH + j, LOG_WIDTH)
    expert = key >> LOG_WIDTH
    pair = s * SEG + sl * WIDTH + (key & (WIDTH - 1))
    routed = expert < E
    row = tl.where(routed, tl.gather(shift, expert, 1) + j, P)  # P: no expert (never read)
    if PAIRS:  # the fused MoE's layout: each row's pair, n on padding rows, and each block's expert
        tl.store(token_of_row_ptr + row, pair, mask=routed)
        b = s * BLOCKS_PER + tl.arange(0, BLOCKS_PER)
        owner = tl.sum(((ends[None, :] <= b[:, None] * ALIGN) & (experts[None, :] < E)).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, owner, mask=b < num_blocks)  # E past the last group
    else:
        tl.store(row_of_pair_ptr + pair, row, mask=pair < n)
        tl.store(token_of_row_ptr + row, pair // TOP_K, mask=routed)
        # rows past the last group are gathered too (never computed): a valid token; at most n of them
        past = tl.sum(rows, axis=0) + offs
        tl.store(token_of_row_ptr + past, 0, mask=past < P)
    if s == 0:
        tl.store(offs_ptr + experts, ends, mask=experts < E)
        pad = totals[:, None] + tl.arange(0, ALIGN)[None, :]
        tl.store(token_of_row_ptr + starts[:, None] + pad, n if PAIRS else 0,
                 mask=(experts[:, None] < E) & (pad < rows[:, None]))


def segment_size(n: int) -> int:
    """Ids per program: ~``PROGRAMS`` segments, a power of two in [MIN_SEG, MAX_SEG]."""
    return min(MAX_SEG, max(MIN_SEG, triton.next_power_of_2(triton.cdiv(max(n, 1), PROGRAMS))))


def plan_rows(topk_ids: torch.Tensor, num_experts: int, align: int, seg: int | None = None,
              num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``moe_grouped_mm.plan_rows`` (its torch form is the reference); int32 rows and tokens.
    ``seg``: ids per program of each kernel, a power of two (default ``segment_size``), in
    ``num_warps`` slices (fewer when seg is small: 2 ids a slice at least)."""
    row_of_pair, token_of_row, offs, _ = _plan(topk_ids, num_experts, align, seg, num_warps, pairs=False)
    return row_of_pair, token_of_row, offs


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int, seg: int | None = None,
                num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_fused_moe.align_by_expert``'s layout (sorted pairs, each block's expert; rows of
    blocks past the last group unwritten) from the plan's two kernels: the same counts and ranks,
    with each row holding its pair, empty experts given no rows, and every program marking its
    share of the blocks. O(pairs) work, where the one-kernel alignment reads every id once per expert."""
    _, sorted_pairs, _, block_expert = _plan(topk_ids, num_experts, block_m, seg, num_warps, pairs=True)
    return sorted_pairs, block_expert


def _plan(topk_ids: torch.Tensor, num_experts: int, align: int, seg: int | None, num_warps: int,
          pairs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two kernels: (row_of_pair, token_of_row, offs, block_expert); with ``pairs`` the second
    holds pairs (``align_pairs``) and the first is not written, else the fourth is empty."""
    M, top_k = topk_ids.shape
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n, E = ids.numel(), num_experts
    # pairs: the fused MoE's worst case (each of min(E, n) groups padded by at most align - 1)
    P = triton.cdiv(n + min(E, n) * (align - 1), align) * align if pairs else n + E * align
    seg = seg or segment_size(n)
    # at least 32 bins: with a handful of experts the tables' tiny shapes failed to compile (sm90)
    bins = max(32, triton.next_power_of_2(E + 1))
    if seg < 2 or seg & (seg - 1) or align & (align - 1) or (E + 1) * seg > 2 ** 30:
        raise ValueError(f"plan_rows: seg {seg} and align {align} must be powers of two, seg >= 2, "
                         f"(E + 1) * seg <= 2**30")
    slices = min(triton.next_power_of_2(num_warps), seg // 2)
    segs = max(1, triton.cdiv(n, seg))
    dev = ids.device
    counts = torch.empty((segs, bins), dtype=torch.int32, device=dev)
    slice_counts = torch.empty((segs, slices, bins), dtype=torch.int32, device=dev)
    row_of_pair = torch.empty(0 if pairs else n, dtype=torch.int32, device=dev)
    token_of_row = torch.empty(P, dtype=torch.int32, device=dev)
    offs = torch.empty(E, dtype=torch.int32, device=dev)
    num_blocks = P // align if pairs else 0
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    _count_kernel[(segs,)](ids, counts, slice_counts, n, E=E, BINS=bins, SEG=seg, SLICES=slices, num_warps=4)
    # counts read per loop step: 64 a thread (32 segments of 256 bins in one step with 4 warps,
    # all loads in flight at once; the loop's steps run one after another)
    table_rows = min(triton.next_power_of_2(segs), max(1, 64 * 32 * num_warps // bins))
    _place_kernel[(segs,)](ids, counts, slice_counts, row_of_pair, token_of_row, offs, block_expert, n, P, segs,
                           num_blocks, E=E, BINS=bins, TOP_K=top_k, ALIGN=align, SEG=seg, SLICES=slices,
                           LOG_WIDTH=(seg // slices).bit_length() - 1, TABLE_ROWS=table_rows, PAIRS=pairs,
                           BLOCKS_PER=triton.next_power_of_2(max(1, triton.cdiv(num_blocks, segs))),
                           num_warps=num_warps)
    return row_of_pair, token_of_row, offs, block_expert


@triton.jit
def _gather_kernel(x_ptr, token_of_row_ptr, offs_ptr, out_ptr, stride_x, P, E: tl.constexpr, K: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[r] = x[token_of_row[r]] for the rows of the experts' groups (r < offs[E - 1]); rows
    past the last group are left unwritten (the grouped GEMM never reads them)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    end = tl.load(offs_ptr + E - 1)
    live = rows < end
    tok = tl.load(token_of_row_ptr + rows, mask=live, other=0).to(tl.int64)
    mask = live[:, None] & (cols[None, :] < K)
    vals = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], vals, mask=mask)


def gather_rows(x: torch.Tensor, token_of_row: torch.Tensor, offs: torch.Tensor, rows: int = 16,
                block_k: int = 512, num_warps: int = 4) -> torch.Tensor:
    """x's rows in the plan's order, [P, K] (``x.index_select(0, token_of_row)`` where the rows
    belong to a group; one read of each needed row, 16-byte accesses)."""
    P, K = token_of_row.shape[0], x.shape[1]
    out = torch.empty((P, K), dtype=x.dtype, device=x.device)
    block_k = min(block_k, triton.next_power_of_2(K))
    _gather_kernel[(triton.cdiv(P, rows), triton.cdiv(K, block_k))](
        x, token_of_row, offs, out, x.stride(0), P, E=offs.shape[0], K=K, ROWS=rows, BLOCK_K=block_k,
        num_warps=num_warps)
    return out
