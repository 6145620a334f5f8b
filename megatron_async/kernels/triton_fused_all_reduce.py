"""Tensor-parallel all-reduce fused with the residual add and the next RMSNorm, one launch.

A row-parallel layer leaves a partial product on every TP rank; the next block needs
``residual + sum(partials)`` (the new residual stream) and its RMSNorm. Unfused that is an
all-reduce kernel and an add + RMSNorm kernel, the summed hidden state going through HBM in
between. Here one kernel, on every rank:

1. writes this rank's partial rows into slot ``rank`` of EVERY rank's symmetric buffer (the
   peers' over NVLink: stores are posted, so they overlap where loads from peers would each
   wait a round trip), in the half of the buffer this call's parity picks (below); a half
   holds world_size slots of the message;
2. meets the other ranks at a barrier (below);
3. reads the world_size slots of its own buffer half (local memory), adds them in float32 IN
   RANK ORDER (the same order on every rank, so every rank holds the same bits), rounds to the
   activation dtype (what the all-reduce's output tensor holds), adds the residual (rounded,
   as ``x + residual``) and writes it, then the RMSNorm of it (``triton_rmsnorm``'s numerics).

Two-shot (``two_shot``, large messages at 4+ ranks, where one-shot's world_size - 1 remote
copies of every row are the cost): each row has an owner rank (rows cut into world_size
contiguous chunks). 1. every rank pushes each row into slot ``rank`` of its owner's buffer; a
barrier; 2. the owner sums its rows' slots in rank order, adds the residual (the same roundings
as above) and pushes that new residual row into slot ``owner`` of every rank's buffer; a second
barrier (its own flags: the pad's second region); 3. every rank reads each row's new residual
from its own buffer, writes it and its RMSNorm. A rank sends (2 - 2 / world_size) messages
instead of world_size - 1 (1.5 against 3 at 4 ranks), at one barrier more; the bits are
one-shot's (one rank sums each row, in rank order, and hands every rank the same row).
``python -m benchmarks all-reduce --fused-rows``: ``TWO_SHOT_MIN_BYTES``.

The barrier, the call counter whose parity picks the half (no exit barrier: a rank one call
ahead writes the other half) and why that is safe: ``triton_p2p_sync``. The buffer and pads
are the fused path's own symmetric allocation, apart from what torch's one-shot / two-shot
kernels use.

Numerics against the unfused path: float32 is bit-identical to torch's one-shot all-reduce
(also rank order, float32 adds) followed by ``add_rms_norm``. bf16 is summed in float32 and
rounded once; torch's one-shot rounds to bf16 after every add (rank order) and NCCL's ring
adds in ring order, so bf16 results can differ from both in the last bit at 3+ ranks (at 2
ranks one add: the same up to a rare double rounding)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_p2p_sync import (buffer_half, call_epoch, check_fits, epoch_barrier,
                                                    finish_call)
from megatron_async.kernels.triton_rmsnorm import MAX_HIDDEN


TWO_SHOT_MIN_BYTES = 512 << 10
"""Messages from this size (at 4+ ranks) take the two-shot kernel: at 4 ranks, hidden 4,096, bf16,
in CUDA graphs on 4x H200: one-shot 12.6 / 16.5 / 20.1 us a call at 64 / 96 / 128 rows (512 KB
to 1 MB), two-shot 11.2 / 12.4 / 13.9; at 32 rows one-shot 9.2 against 10.0 for a first form of
the two-shot kernel (its second barrier costs ~2 us: 8.0 against 6.1 at one row)."""


@triton.jit
def _new_residual(buf, msg, base, offs, mask, res_ptr, W: tl.constexpr):
    """The W ranks' rows at ``buf`` summed in float32 in rank order, rounded to the activation
    dtype (the all-reduce's output), plus the residual row, rounded (``x + residual``)."""
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for r in tl.static_range(W):
        acc += tl.load(buf + r * msg + base + offs, mask=mask, other=0.0).to(tl.float32)
    reduced = acc.to(res_ptr.dtype.element_ty).to(tl.float32)  # the all-reduce's output, as the unfused path holds it
    res = tl.load(res_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    return reduced + res


@triton.jit
def _store_norm(h, w, out_ptr, res_out_ptr, base, offs, mask, eps, N: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr):
    """Write the new residual row ``h`` and its RMSNorm (``triton_rmsnorm``'s numerics)."""
    h = h.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + base + offs, h, mask=mask)
    hf = h.to(tl.float32)
    y = hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
    if CAST_BEFORE_WEIGHT:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + base + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _call_start(buf_table_ptr, state_ptr, rank, half, M, N: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
    """(row lanes, their mask, one message's elements, the call's epoch, this rank's buffer half)."""
    offs = tl.arange(0, BLOCK_N)
    epoch = call_epoch(state_ptr)
    # W * M * N <= half < 2**31: world_size messages fit one half of the buffer
    return offs, offs < N, M * N, epoch, buffer_half(buf_table_ptr, rank, epoch, half, DTYPE)


@triton.jit
def _two_shot_kernel(
    x_ptr, buf_table_ptr, pad_table_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, state_ptr, M, rank, half, eps,
    second_pad, N: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
    BARRIER: tl.constexpr,
):
    # Program p takes the rows r with r % programs == p in every phase, so each barrier pairs the
    # program that wrote a row with the one that reads it, on every rank.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = res_ptr.dtype.element_ty
    offs, mask, msg, epoch, my_buf = _call_start(buf_table_ptr, state_ptr, rank, half, M, N, BLOCK_N, dtype)
    chunk = tl.cdiv(M, W)  # rows [r * chunk, (r + 1) * chunk) are rank r's
    for row in range(pid, M, num_programs):  # 1. each row into slot `rank` of its owner's buffer
        x = tl.load(x_ptr + row * N + offs, mask=mask)
        tl.store(buffer_half(buf_table_ptr, row // chunk, epoch, half, dtype) + rank * msg + row * N + offs, x,
                 mask=mask)
    if BARRIER:
        epoch_barrier(pad_table_ptr, pid, rank, epoch, W)
    lo = rank * chunk
    first = lo + ((pid - lo) % num_programs + num_programs) % num_programs  # this program's first own row
    for row in range(first, tl.minimum(lo + chunk, M), num_programs):  # 2. own rows: sum, add, push
        h = _new_residual(my_buf, msg, row * N, offs, mask, res_ptr, W).to(dtype)
        for r in tl.static_range(W):  # slot `rank` of every buffer (its own rows there: free since phase 1)
            tl.store(buffer_half(buf_table_ptr, r, epoch, half, dtype) + rank * msg + row * N + offs, h, mask=mask)
    if BARRIER:
        epoch_barrier(pad_table_ptr, second_pad + pid, rank, epoch, W)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, M, num_programs):  # 3. every row's new residual, from its owner's slot
        h = tl.load(my_buf + (row // chunk) * msg + row * N + offs, mask=mask, other=0.0)
        _store_norm(h, w, out_ptr, res_out_ptr, row * N, offs, mask, eps, N, CAST_BEFORE_WEIGHT)
    finish_call(state_ptr, epoch)


@triton.jit
def _fused_kernel(
    x_ptr,
    buf_table_ptr,
    pad_table_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    state_ptr,
    M,
    rank,
    half,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    W: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    BARRIER: tl.constexpr,
    SPLITS: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = res_ptr.dtype.element_ty
    offs, mask, msg, epoch, my_buf = _call_start(buf_table_ptr, state_ptr, rank, half, M, N, BLOCK_N, dtype)
    for row in range(pid, M, num_programs):
        base = row * N
        if SPLITS == 0:
            x = tl.load(x_ptr + base + offs, mask=mask)
        else:  # float32 K-split partials [SPLITS, M, N], summed in split order, rounded as the GEMM's output
            x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
            for i in tl.static_range(1, SPLITS):
                x += tl.load(x_ptr + i * msg + base + offs, mask=mask, other=0.0)
            x = x.to(dtype)
        for r in tl.static_range(W):  # slot `rank` of every rank's buffer
            tl.store(buffer_half(buf_table_ptr, r, epoch, half, dtype) + rank * msg + base + offs, x, mask=mask)
    if BARRIER:
        epoch_barrier(pad_table_ptr, pid, rank, epoch, W)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, M, num_programs):  # every rank's rows, in this rank's own buffer
        h = _new_residual(my_buf, msg, row * N, offs, mask, res_ptr, W)
        _store_norm(h, w, out_ptr, res_out_ptr, row * N, offs, mask, eps, N, CAST_BEFORE_WEIGHT)
    finish_call(state_ptr, epoch)


def supported(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, world_size: int) -> bool:
    """Whether the fused kernel takes these tensors (the same answer on every rank for equal
    shapes): 2-d contiguous rows of one dtype (bf16 / fp16 / fp32), or [splits, rows, hidden]
    float32 K-split partials of rows in the residual's dtype; a hidden size that keeps 16-byte
    rows and fits one program's registers, a power-of-two world."""
    n = x.shape[-1]
    split = x.dim() == 3 and x.dtype == torch.float32 and residual.dtype != torch.float32
    return ((x.dim() == 2 and x.dtype == residual.dtype or split)
            and residual.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and residual.dtype == weight.dtype and residual.shape == x.shape[-2:]
            and weight.shape == (n,) and n <= MAX_HIDDEN and (n * residual.element_size()) % 16 == 0
            and x.is_contiguous() and residual.is_contiguous() and world_size & (world_size - 1) == 0)


def takes_two_shot(x: torch.Tensor, residual: torch.Tensor, world_size: int) -> bool:
    """Whether a call of these (``supported``) tensors runs the two-shot kernel: whole rows (not
    K-split partials) of ``TWO_SHOT_MIN_BYTES``+ at 4+ ranks (at 2 ranks both kernels send one
    message). The same answer on every rank for equal shapes."""
    return x.dim() == 2 and world_size >= 4 and residual.numel() * residual.element_size() >= TWO_SHOT_MIN_BYTES


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cast_before_weight: bool,
    buffer_table: torch.Tensor,
    pad_table: torch.Tensor,
    state: torch.Tensor,
    half_bytes: int,
    rank: int,
    max_programs: int,
    barrier: bool = True,
    two_shot: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + sum_r x_r) * weight, residual + sum_r x_r) over the TP ranks, new tensors.
    ``x`` may be [splits, rows, hidden] float32 K-split partials (``triton_split_linear``): each
    rank sums its own in split order and rounds to the residual's dtype before the exchange.

    ``buffer_table`` / ``pad_table``: int64 [W] on x's device, the address of every rank's
    staging buffer (two halves of ``half_bytes``, each >= W times the residual's bytes, 16-byte
    aligned) and signal pad (int32 slots: at least ``max_programs * W``, twice that with
    ``two_shot``), this rank's at ``rank``. ``state``: int32 [2] on x's device, zeros before the
    first call, then only this kernel's (the call counter whose parity picks the half).
    ``max_programs`` caps the grid. ``two_shot``: the two-shot kernel where ``takes_two_shot``
    (its second barrier's flags start at slot ``max_programs * W``). ``barrier=False`` skips the
    barriers (tests on one process whose "peers" are already in their buffers); never on real
    ranks."""
    world = buffer_table.numel()
    if not supported(x, residual, weight, world):
        raise ValueError(f"all_reduce_add_rms_norm: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype}, weight {tuple(weight.shape)} {weight.dtype}, world {world}")
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    M, n = residual.shape
    if M == 0:
        return out, res_out
    check_fits(world * residual.numel() * residual.element_size(), half_bytes,
               f"all_reduce_add_rms_norm: {world} messages of {tuple(residual.shape)} {residual.dtype}")
    block = triton.next_power_of_2(n)
    common = dict(N=n, BLOCK_N=block, W=world, CAST_BEFORE_WEIGHT=cast_before_weight, BARRIER=barrier,
                  num_warps=min(max(block // 512, 1), 16))
    grid = (min(M, max_programs),)
    if two_shot and takes_two_shot(x, residual, world):
        _two_shot_kernel[grid](x, buffer_table, pad_table, residual, weight, out, res_out, state, M, rank,
                               half_bytes // residual.element_size(), eps, max_programs, **common)
        return out, res_out
    _fused_kernel[grid](x, buffer_table, pad_table, residual, weight, out, res_out, state, M, rank,
                        half_bytes // residual.element_size(), eps, SPLITS=x.shape[0] if x.dim() == 3 else 0, **common)
    return out, res_out
