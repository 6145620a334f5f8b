"""The batched LoRA op over rows grouped by adapter slot (``ForwardBatch.lora_groups``): the same
split-K shrink / expand arithmetic as ``triton_lora``, but one program per (tile, chunk) or (tile,
column block) where a tile is up to ``block_m`` rows of ONE slot, read from ``x`` and written to
``y`` through the step's permutation (``LoRAGroups.order``). Every MMA row is a row of the tile's
adapter, every tile reads one adapter's A and B, and the tiles of slot -1 do not exist: a row of
the base model costs nothing. Each y row lies in one tile, so each (row, column block) is written
by one program (no atomics).

The launch grid is fixed by T (the tile table's length), so a CUDA graph replays any mix of
adapters; a program past the table's tiles (rows = 0) returns at once.

Batch invariance: a row's K walk (chunk bounds, BLOCK_K steps), its split sum order (0, 1, ...)
and the expand's rank walk depend on K and the tile sizes only, never on which rows share its
tile; batch-invariant mode fixes the tile sizes (``grouped_tiles``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.forward_batch import LoRAGroups
from megatron_async.kernels.triton_lora import (DECODE_TILES, PREFILL_TILES, LoRATiles, add_rows, expand_rows,
                                                shrink_rows)
from megatron_async.kernels.triton_paged_common import TL_DTYPES, dot_args

GROUPED_DECODE_ROWS = 256
"""Up to this many rows (and always in batch-invariant mode) the decode tiles: 16-row tiles fit a
decode step's few rows per adapter; above, 64-row tiles with fewer splits."""


def grouped_tiles(rows: int, batch_invariant: bool) -> LoRATiles:
    return DECODE_TILES if batch_invariant or rows <= GROUPED_DECODE_ROWS else PREFILL_TILES


@triton.jit
def _tile(tiles_ptr):
    """This program's tile: (slot, first position in the order, rows)."""
    row = tiles_ptr + tl.program_id(0) * 3
    return tl.load(row), tl.load(row + 1), tl.load(row + 2)


@triton.jit
def _grouped_shrink_kernel(x_ptr, a_ptr, p_ptr, order_ptr, tiles_ptr, K, SR,
                           stride_xt, stride_al, stride_ar, stride_ps, stride_pt,
                           R_BLOCKS: tl.constexpr, K_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    lora, first, rows = _tile(tiles_ptr)
    if rows > 0:
        split, pid_r = tl.program_id(1) // R_BLOCKS, tl.program_id(1) % R_BLOCKS
        offs_m = tl.arange(0, BLOCK_M)
        m_in = offs_m < rows
        pos = first + offs_m  # partials are kept in sorted order: a tile's rows are contiguous there
        token = tl.load(order_ptr + pos, mask=m_in, other=0).to(tl.int64)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_in = offs_r < SR
        k_lo = split * K_CHUNK
        k_hi = tl.minimum(k_lo + K_CHUNK, K)
        x_rows = x_ptr + token[:, None] * stride_xt
        a_cols = a_ptr + lora.to(tl.int64) * stride_al + offs_r[None, :] * stride_ar
        acc = shrink_rows(x_rows, a_cols, m_in, r_in, k_lo, k_hi, BLOCK_M, BLOCK_R, BLOCK_K, DOT_DTYPE,
                          DOT_PRECISION)
        out = p_ptr + split * stride_ps + pos[:, None] * stride_pt + offs_r[None, :]
        tl.store(out, acc, mask=m_in[:, None] & r_in[None, :])


@triton.jit
def _grouped_expand_kernel(p_ptr, b_ptr, y_ptr, order_ptr, tiles_ptr, scale_ptr, starts_ptr, N, R,
                           stride_ps, stride_pt, stride_bl, stride_bn, stride_yt, stride_scale,
                           SPLITS: tl.constexpr, NUM_SLICES: tl.constexpr, S_DTYPE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    lora, first, rows = _tile(tiles_ptr)
    if rows > 0:
        offs_m = tl.arange(0, BLOCK_M)
        m_in = offs_m < rows
        pos = first + offs_m
        token = tl.load(order_ptr + pos, mask=m_in, other=0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        delta = expand_rows(p_ptr + pos[:, None] * stride_pt, stride_ps, m_in,
                            b_ptr + lora.to(tl.int64) * stride_bl, stride_bn, scale_ptr + lora * stride_scale,
                            starts_ptr, offs_n, R, y_ptr, SPLITS, NUM_SLICES, S_DTYPE, BLOCK_M, BLOCK_N, BLOCK_R,
                            DOT_DTYPE, DOT_PRECISION)
        add_rows(y_ptr + token[:, None] * stride_yt + offs_n[None, :], delta, m_in[:, None] & (offs_n < N)[None, :],
                 y_ptr)


def lora_add_grouped(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                     groups: LoRAGroups, starts: torch.Tensor, batch_invariant: bool = False) -> None:
    """``triton_lora.lora_add_triton`` over ``groups`` (built for these T rows, ``a``'s L slots and
    this mode: ``lora_groups.group_lora_rows``)."""
    T, K = x.shape
    SR = a.shape[1]
    N, R = b.shape[1], b.shape[2]
    if T == 0:
        return
    t = grouped_tiles(T, batch_invariant)
    if groups.block_m != t.block_m or groups.order.shape[0] != T:
        raise ValueError(f"LoRA groups of {groups.order.shape[0]} rows in {groups.block_m}-row tiles do not fit "
                         f"{T} rows in {t.block_m}-row tiles")
    x = x.contiguous()
    splits = triton.cdiv(K, t.k_chunk)
    partials = torch.empty(splits, T, SR, dtype=torch.float32, device=x.device)
    num_tiles = groups.tiles.shape[0]
    dot = dot_args(_grouped_shrink_kernel, x.dtype)
    block_r = min(64, max(16, triton.next_power_of_2(SR)))
    r_blocks = triton.cdiv(SR, block_r)
    _grouped_shrink_kernel[(num_tiles, splits * r_blocks)](
        x, a, partials, groups.order, groups.tiles, K, SR, x.stride(0), a.stride(0), a.stride(1), partials.stride(0),
        partials.stride(1), R_BLOCKS=r_blocks, K_CHUNK=t.k_chunk, BLOCK_M=t.block_m, BLOCK_R=block_r,
        BLOCK_K=t.block_k, **dot)
    _grouped_expand_kernel[(num_tiles, triton.cdiv(N, t.block_n))](
        partials, b, y, groups.order, groups.tiles, scale, starts, N, R, partials.stride(0), partials.stride(1),
        b.stride(0), b.stride(1), y.stride(0), scale.stride(0), SPLITS=splits, NUM_SLICES=SR // R,
        S_DTYPE=TL_DTYPES[x.dtype], BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_R=max(16, triton.next_power_of_2(R)), **dot)
