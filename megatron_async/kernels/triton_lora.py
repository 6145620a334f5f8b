"""Triton kernels of the batched LoRA op: ``shrink`` (each row's ``x @ A[slot].T``) and
``expand`` (``y[:, slice] += scale[slot, j] * s_j @ B[slot, slice].T`` for every output slice j),
every row with its own adapter slot, -1 adding nothing.

Split-K shrink: K is cut into fixed chunks of ``k_chunk`` columns, one program per (row tile,
chunk), each writing float32 partial sums to ``partials[split, t, S*R]``; the expand sums a row's
partials ``SPLIT_GROUP`` splits at a time (a fixed tree within a group, the groups in split
order), rounds the sum to the model dtype (PEFT's rank-space product) and expands it. A batch-1
decode step thus reads A with K/k_chunk programs instead of walking all of K in one.

Slots: a program of the grid's last axis handles the q-th, (q+Q)-th, ... distinct adapter slot
among its tile's rows (Q = min(slots, rows, ``slot_programs``)), found on the device from the
tile's own slots: no sort and no host reads, so a step's launch is the same for any mix of
adapters (a CUDA graph replays every mix); a tile without adapter rows does no loads beyond its
slots and no FLOPs.

Batch invariance: a row's result depends only on its own row and adapter. Its K walk (chunk
bounds, BLOCK_K steps), the split sum order and the expand's rank walk are fixed by K and the
tile sizes, and batch-invariant mode fixes the tile sizes (``lora_tiles``); the default mode takes
larger tiles and chunks above ``PREFILL_ROWS`` rows, which changes float32 sum orders only."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_paged_common import TL_DTYPES, dot_args


SPLIT_GROUP = tl.constexpr(8)
"""K splits whose partials the expand loads at once and sums as a tree (groups summed in order)."""


@dataclass(frozen=True)
class LoRATiles:
    block_m: int  # rows per program (a tl.dot needs 16 or more)
    k_chunk: int  # K columns of one shrink split
    block_k: int  # K columns of one shrink step (divides k_chunk; = k_chunk: the split's loads at once)
    block_n: int  # output columns per expand program
    slot_programs: int  # programs per row tile sharing its distinct slots (more: parallel, but empty
    # programs where a tile holds fewer slots)


DECODE_TILES = LoRATiles(block_m=16, k_chunk=256, block_k=256, block_n=128, slot_programs=8)
PREFILL_TILES = LoRATiles(block_m=64, k_chunk=1024, block_k=128, block_n=128, slot_programs=4)
PREFILL_ROWS = 16


def lora_tiles(rows: int, batch_invariant: bool) -> LoRATiles:
    """Decode tiles (many K splits: latency-bound reads of A) up to ``PREFILL_ROWS`` rows and always
    in batch-invariant mode; above, taller tiles and fewer splits (fewer partials for the expand
    to sum again per column block)."""
    return DECODE_TILES if batch_invariant or rows <= PREFILL_ROWS else PREFILL_TILES


@triton.jit
def _next_slot(slots, after):
    """The smallest slot among the tile's rows above ``after``; 2**31 - 1 when there is none."""
    return tl.min(tl.where(slots > after, slots, 2147483647), axis=0)


@triton.jit
def _first_own_slot(slots):
    """This program's first slot: the tile's ``program_id(2)``-th distinct slot."""
    lora = _next_slot(slots, -1)
    for _ in range(tl.program_id(2)):
        lora = _next_slot(slots, lora)
    return lora


@triton.jit
def _next_own_slot(slots, lora):
    """This program's next slot: ``num_programs(2)`` distinct slots further."""
    for _ in range(tl.num_programs(2)):
        lora = _next_slot(slots, lora)
    return lora


@triton.jit
def shrink_rows(x_rows, a_cols, rows_in, r_in, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BLOCK_M, BLOCK_R] float32: the rows' ``x @ A.T`` over columns ``k_lo:k_hi`` in BLOCK_K steps
    (``x_rows``: each row's x pointer, ``a_cols``: the adapter's A pointer of each rank column)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_in = k < k_hi
        x = tl.load(x_rows + k[None, :], mask=rows_in[:, None] & k_in[None, :], other=0.0)
        a = tl.load(a_cols + k[:, None], mask=k_in[:, None] & r_in[None, :], other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), a.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def expand_rows(p_rows, stride_ps, rows_in, b_lora, stride_bn, scale_lora, starts_ptr, offs_n, R, y_ptr,
                 SPLITS: tl.constexpr, NUM_SLICES: tl.constexpr, S_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32: the rows' scaled ``s @ B.T`` in columns ``offs_n`` (``p_rows``:
    each row's split-0 partials, ``b_lora`` / ``scale_lora``: the adapter's B and scales), each
    slice's product rounded to ``y_ptr``'s dtype."""
    offs_r = tl.arange(0, BLOCK_R)
    r_in = offs_r < R
    delta = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(NUM_SLICES):  # a column belongs to one slice: the others add nothing to it
        n_lo = tl.load(starts_ptr + j)
        n_hi = tl.load(starts_ptr + j + 1)
        n_in = (offs_n >= n_lo) & (offs_n < n_hi)
        if tl.max(n_in.to(tl.int32), axis=0) > 0:
            part_rows = p_rows + (j * R + offs_r)[None, :]
            keep_s = rows_in[:, None] & r_in[None, :]
            s = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for g in tl.static_range(0, SPLITS, SPLIT_GROUP):  # groups in split order; the tree inside
                # a group fixed by its size: the sum depends on K alone. A group's loads issue together
                # (one after another, a batch-1 expand waited ~0.4 us per split).
                offs_g = g + tl.arange(0, SPLIT_GROUP)
                keep_g = (offs_g < SPLITS)[:, None, None] & keep_s[None, :, :]
                s += tl.sum(tl.load(part_rows[None, :, :] + offs_g[:, None, None] * stride_ps, mask=keep_g,
                                    other=0.0), axis=0)
            s = s.to(S_DTYPE)  # the rank-space product in the model dtype, as PEFT rounds it
            b = tl.load(b_lora + offs_n[None, :] * stride_bn + offs_r[:, None], mask=r_in[:, None] & n_in[None, :],
                        other=0.0)
            part = tl.dot(s.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=DOT_PRECISION)
            part = part.to(y_ptr.dtype.element_ty).to(tl.float32)  # the expanded product in the model dtype
            scale = tl.load(scale_lora + j)
            delta = tl.where(n_in[None, :], part * scale, delta)
    return delta


@triton.jit
def add_rows(y_tile, delta, keep, y_ptr):
    """``y_tile += delta`` where ``keep``, delta rounded to ``y_ptr``'s dtype first (like PEFT's
    ``lora_B(...) * scaling``)."""
    y = tl.load(y_tile, mask=keep, other=0.0)
    delta = delta.to(y_ptr.dtype.element_ty)
    tl.store(y_tile, (y.to(tl.float32) + delta.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, p_ptr, slots_ptr, T, K, SR,
                   stride_xt, stride_al, stride_ar, stride_ps, stride_pt,
                   R_BLOCKS: tl.constexpr, K_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    split, pid_r = tl.program_id(1) // R_BLOCKS, tl.program_id(1) % R_BLOCKS
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + offs_m, mask=offs_m < T, other=-1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_in = offs_r < SR
    k_lo = split * K_CHUNK
    k_hi = tl.minimum(k_lo + K_CHUNK, K)
    x_rows = x_ptr + offs_m[:, None] * stride_xt
    out = p_ptr + split * stride_ps + offs_m[:, None] * stride_pt + offs_r[None, :]
    lora = _first_own_slot(slots)
    while lora < 2147483647:
        mine = slots == lora
        a_cols = a_ptr + lora.to(tl.int64) * stride_al + offs_r[None, :] * stride_ar
        acc = shrink_rows(x_rows, a_cols, mine, r_in, k_lo, k_hi, BLOCK_M, BLOCK_R, BLOCK_K, DOT_DTYPE,
                          DOT_PRECISION)
        tl.store(out, acc, mask=mine[:, None] & r_in[None, :])
        lora = _next_own_slot(slots, lora)


@triton.jit
def _expand_kernel(p_ptr, b_ptr, y_ptr, slots_ptr, scale_ptr, starts_ptr, T, N, R,
                   stride_ps, stride_pt, stride_bl, stride_bn, stride_yt, stride_scale,
                   SPLITS: tl.constexpr, NUM_SLICES: tl.constexpr, S_DTYPE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + offs_m, mask=offs_m < T, other=-1)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    y_tile = y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :]
    lora = _first_own_slot(slots)
    while lora < 2147483647:
        mine = slots == lora
        delta = expand_rows(p_ptr + offs_m[:, None] * stride_pt, stride_ps, mine,
                            b_ptr + lora.to(tl.int64) * stride_bl, stride_bn, scale_ptr + lora * stride_scale,
                            starts_ptr, offs_n, R, y_ptr, SPLITS, NUM_SLICES, S_DTYPE, BLOCK_M, BLOCK_N, BLOCK_R,
                            DOT_DTYPE, DOT_PRECISION)
        add_rows(y_tile, delta, mine[:, None] & (offs_n < N)[None, :], y_ptr)
        lora = _next_own_slot(slots, lora)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                    slots: torch.Tensor, starts: torch.Tensor, batch_invariant: bool = False,
                    tiles: LoRATiles | None = None) -> None:
    """In place: ``y[t, slice j] += scale[l, j] * (x[t] @ A[l, jR:(j+1)R].T) @ B[l, slice j].T`` for
    every row t with ``slots[t] == l >= 0``. Shapes: x [T, K], y [T, N], A [L, S*R, K], B [L, N, R],
    scale [L, S] float32, slots [>= T] int32, starts [S + 1] int32 (slice j: columns
    ``starts[j]:starts[j+1]`` of y). ``tiles``: ``lora_tiles(T, batch_invariant)`` unless given."""
    T, K = x.shape
    L, SR, _ = a.shape
    N, R = b.shape[1], b.shape[2]
    if T == 0:
        return
    t = tiles or lora_tiles(T, batch_invariant)
    if t.k_chunk % t.block_k:
        raise ValueError(f"k_chunk {t.k_chunk} is not a multiple of block_k {t.block_k}")
    x = x.contiguous()
    splits = triton.cdiv(K, t.k_chunk)
    partials = torch.empty(splits, T, SR, dtype=torch.float32, device=x.device)
    tiles_m = triton.cdiv(T, t.block_m)
    slot_programs = min(L, T, t.slot_programs)
    dot = dot_args(_shrink_kernel, x.dtype)
    block_r = min(64, max(16, triton.next_power_of_2(SR)))
    r_blocks = triton.cdiv(SR, block_r)
    _shrink_kernel[(tiles_m, splits * r_blocks, slot_programs)](
        x, a, partials, slots, T, K, SR, x.stride(0), a.stride(0), a.stride(1), partials.stride(0),
        partials.stride(1), R_BLOCKS=r_blocks, K_CHUNK=t.k_chunk, BLOCK_M=t.block_m, BLOCK_R=block_r,
        BLOCK_K=t.block_k, **dot)
    _expand_kernel[(tiles_m, triton.cdiv(N, t.block_n), slot_programs)](
        partials, b, y, slots, scale, starts, T, N, R, partials.stride(0), partials.stride(1), b.stride(0),
        b.stride(1), y.stride(0), scale.stride(0), SPLITS=splits, NUM_SLICES=SR // R, S_DTYPE=TL_DTYPES[x.dtype],
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_R=max(16, triton.next_power_of_2(R)), **dot)
