"""The expert-parallel exchange's two collectives through CUDA P2P: an all-gather and a
reduce-scatter over symmetric buffers, one kernel each (``parallel/p2p_exchange.py`` owns the
buffers; NCCL stays the fallback).

Decode exchanges are small (a few hundred KB to ~1 MB per MoE layer) and there are two per MoE
layer, so NCCL's fixed cost per collective is most of their time. Here, on every rank:

- all-gather: copy this rank's rows into its buffer, meet the other ranks at a barrier, read
  every rank's buffer (rank order) into the output;
- reduce-scatter: copy this rank's whole input into its buffer, meet, read every rank's copy of
  THIS rank's slice and add them in float32 in rank order (the same order on every rank), round
  once.

Each program copies exactly the offsets it (and the same program on every peer) reads after the
barrier, so the barrier pairs programs, not whole grids. Both kernels share one call counter
whose parity picks the buffer half a call uses, and one barrier per call (no exit barrier:
``triton_p2p_sync``). ``barrier=False`` skips the barrier for tests in one process whose
"peers" are already in their buffers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_p2p_sync import (buffer_half, call_epoch, check_fits, epoch_barrier,
                                                    finish_call)


@triton.jit
def _all_gather_kernel(x_ptr, buf_table_ptr, pad_table_ptr, state_ptr, out_ptr, n, rank, half,
                       W: tl.constexpr, BLOCK: tl.constexpr, BARRIER: tl.constexpr):
    # n int32 words per rank; rank r's words land at out[r * n : (r + 1) * n]
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    epoch = call_epoch(state_ptr)
    my_buf = buffer_half(buf_table_ptr, rank, epoch, half, tl.int32)
    for start in range(pid * BLOCK, n, step):
        idx = start + offs
        tl.store(my_buf + idx, tl.load(x_ptr + idx, mask=idx < n), mask=idx < n)
    if BARRIER:
        epoch_barrier(pad_table_ptr, pid, rank, epoch, W)
    for r in tl.static_range(W):
        peer = buffer_half(buf_table_ptr, r, epoch, half, tl.int32)
        for start in range(pid * BLOCK, n, step):
            idx = start + offs
            tl.store(out_ptr + r * n + idx, tl.load(peer + idx, mask=idx < n), mask=idx < n)
    finish_call(state_ptr, epoch)


@triton.jit
def _reduce_scatter_kernel(x_ptr, buf_table_ptr, pad_table_ptr, state_ptr, out_ptr, n, rank, half,
                           W: tl.constexpr, BLOCK: tl.constexpr, BARRIER: tl.constexpr):
    # x: W slices of n elements (slice d for rank d); out: the sum of every rank's slice ``rank``
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    dtype = x_ptr.dtype.element_ty
    epoch = call_epoch(state_ptr)
    my_buf = buffer_half(buf_table_ptr, rank, epoch, half, dtype)
    for start in range(pid * BLOCK, n, step):
        idx = start + offs
        for d in tl.static_range(W):  # every destination's slice, at the offsets this program pairs with
            tl.store(my_buf + d * n + idx, tl.load(x_ptr + d * n + idx, mask=idx < n), mask=idx < n)
    if BARRIER:
        epoch_barrier(pad_table_ptr, pid, rank, epoch, W)
    for start in range(pid * BLOCK, n, step):
        idx = start + offs
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(W):
            peer = buffer_half(buf_table_ptr, r, epoch, half, dtype)
            acc += tl.load(peer + rank * n + idx, mask=idx < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=idx < n)
    finish_call(state_ptr, epoch)


_BLOCK = 1024


def _grid(n: int, max_programs: int) -> tuple[int]:
    return (max(1, min(triton.cdiv(n, _BLOCK), max_programs)),)


def all_gather(x: torch.Tensor, buffer_table: torch.Tensor, pad_table: torch.Tensor, state: torch.Tensor,
               half_bytes: int, rank: int, max_programs: int, barrier: bool = True) -> torch.Tensor:
    """[W * rows, ...] from every rank's contiguous ``x`` [rows, ...] (a whole number of int32
    words). ``buffer_table`` / ``pad_table``: int64 [W], every rank's buffer (two halves of
    ``half_bytes`` >= x's bytes) and signal pad (>= max_programs * W int32 flags); ``state``:
    the exchange's call counter (int32 [2], zeros at first: ``triton_p2p_sync``)."""
    check_fits(x.numel() * x.element_size(), half_bytes, f"P2P exchange: {tuple(x.shape)} {x.dtype}")
    world = buffer_table.numel()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    words = x.numel() * x.element_size() // 4
    if words:
        _all_gather_kernel[_grid(words, max_programs)](x.view(-1).view(torch.int32), buffer_table, pad_table, state,
                                                       out.view(-1).view(torch.int32), words, rank, half_bytes // 4,
                                                       W=world, BLOCK=_BLOCK, BARRIER=barrier, num_warps=4)
    return out


def reduce_scatter(x: torch.Tensor, buffer_table: torch.Tensor, pad_table: torch.Tensor, state: torch.Tensor,
                   half_bytes: int, rank: int, max_programs: int, barrier: bool = True) -> torch.Tensor:
    """[rows / W, ...]: this rank's slice of the sum of every rank's contiguous ``x`` [rows, ...]
    (float32 adds in rank order, one rounding). Tables and state as in ``all_gather``."""
    check_fits(x.numel() * x.element_size(), half_bytes, f"P2P exchange: {tuple(x.shape)} {x.dtype}")
    world = buffer_table.numel()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    n = out.numel()
    if n:
        _reduce_scatter_kernel[_grid(n, max_programs)](x, buffer_table, pad_table, state, out, n, rank,
                                                       half_bytes // x.element_size(),
                                                       W=world, BLOCK=_BLOCK, BARRIER=barrier, num_warps=4)
    return out
