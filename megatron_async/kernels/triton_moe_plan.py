"""The row plan of the grouped-GEMM MoE (``moe_grouped_mm.plan_rows``) in two kernels, and the
gather of x's rows in its order. The plan's torch form is ~30 small kernels (a sort, searches,
scatters), ~0.2 ms of a Qwen3-30B-A3B layer at 8,192 tokens with its launch gaps.

1. ``_count_kernel``, one program per segment of SEG ids: the segment's histogram of experts
   (ids outside [0, E) in bin E) into its row of ``counts`` [segments, BINS] (no atomics).
2. ``_place_kernel``, one program per (expert, segment): every expert's total and this expert's
   count in the earlier segments (from ``counts``) give where the segment's pairs of this expert
   go; their rows in pair order, the tokens they read; program (e, 0) also writes e's offset
   and padding rows, expert E-1's programs the rows of pairs of no expert and past the groups.
Graph-safe: grids and bounds come from shapes."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, n, E: tl.constexpr, BINS: tl.constexpr, SEG: tl.constexpr):
    s = tl.program_id(0)
    offs = s * SEG + tl.arange(0, SEG)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=E)
    hist = tl.histogram(tl.where((ids >= 0) & (ids < E), ids, E), BINS)
    tl.store(counts_ptr + s * BINS + tl.arange(0, BINS), hist)


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, row_of_pair_ptr, token_of_row_ptr, offs_ptr, n, P, num_segs,
                  E: tl.constexpr, BINS: tl.constexpr, TOP_K: tl.constexpr, ALIGN: tl.constexpr,
                  SEG: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    s = tl.program_id(1)
    experts = tl.arange(0, BINS)
    totals = tl.zeros((BINS,), dtype=tl.int32)
    before = tl.zeros((BINS,), dtype=tl.int32)  # each expert's pairs in segments before s
    for t in range(0, num_segs):
        row = tl.load(counts_ptr + t * BINS + experts)
        totals += row
        before += tl.where(t < s, row, 0)
    # each expert's rows: its pairs rounded up to ALIGN, at least ALIGN (no empty group)
    rows = tl.where(experts < E, (tl.maximum(totals, 1) + ALIGN - 1) // ALIGN * ALIGN, 0)
    start = tl.sum(tl.where(experts < e, rows, 0), axis=0)
    mine = tl.sum(tl.where(experts == e, rows, 0), axis=0)
    placed = tl.sum(tl.where(experts == e, before, 0), axis=0)
    for b in range(0, SEG, BLOCK):
        offs = s * SEG + b + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        match = (ids == e).to(tl.int32)
        row = start + placed + tl.cumsum(match, axis=0) - match
        tl.store(token_of_row_ptr + row, offs // TOP_K, mask=match > 0)
        tl.store(row_of_pair_ptr + offs, row, mask=match > 0)
        if e == E - 1:  # pairs of no expert: row P (never read)
            tl.store(row_of_pair_ptr + offs, P, mask=(offs < n) & ((ids < 0) | (ids >= E)))
        placed += tl.sum(match, axis=0)
    if s == 0:
        count = tl.sum(tl.where(experts == e, totals, 0), axis=0)
        tl.store(offs_ptr + e, start + mine)
        pad = count + tl.arange(0, ALIGN)
        tl.store(token_of_row_ptr + start + pad, 0, mask=pad < mine)
        if e == E - 1:  # rows past the last group are gathered too (never computed): a valid token
            for r in range(start + mine, P, BLOCK):
                offs = r + tl.arange(0, BLOCK)
                tl.store(token_of_row_ptr + offs, 0, mask=offs < P)


def plan_rows(topk_ids: torch.Tensor, num_experts: int, align: int, seg: int = 4096,
              block: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``moe_grouped_mm.plan_rows`` (its torch form is the reference); int32 rows and tokens.
    ``seg``: ids per segment (a program of each kernel); ``block``: ids per loop step."""
    M, top_k = topk_ids.shape
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n, E = ids.numel(), num_experts
    P = n + E * align
    bins = triton.next_power_of_2(E + 1)
    seg = min(seg, max(16, triton.next_power_of_2(max(n, 1))))
    block = min(block, seg)
    segs = max(1, triton.cdiv(n, seg))
    counts = torch.empty((segs, bins), dtype=torch.int32, device=ids.device)
    row_of_pair = torch.empty(n, dtype=torch.int32, device=ids.device)
    token_of_row = torch.empty(P, dtype=torch.int32, device=ids.device)
    offs = torch.empty(E, dtype=torch.int32, device=ids.device)
    _count_kernel[(segs,)](ids, counts, n, E=E, BINS=bins, SEG=seg, num_warps=4)
    _place_kernel[(E, segs)](ids, counts, row_of_pair, token_of_row, offs, n, P, segs, E=E, BINS=bins,
                             TOP_K=top_k, ALIGN=align, SEG=seg, BLOCK=block, num_warps=4)
    return row_of_pair, token_of_row, offs


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
