"""The LoRA op without a K split, the baseline ``kernel-times lora`` times ``triton_lora`` against: a
shrink program per (16-row tile, rank block, adapter slot) walking all of K, an expand program per
(tile, column block, slot); a program whose tile holds no row of its slot returns at once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_paged_common import dot_args


@triton.jit
def _own_rows(slots_ptr, T, BLOCK_M: tl.constexpr):
    """This program's tile of rows (grid axis 0), which of them hold its adapter slot (axis 2),
    and whether any does (else the program has nothing to do)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_in = offs_m < T
    slots = tl.load(slots_ptr + offs_m, mask=m_in, other=-1)
    mine = m_in & (slots == tl.program_id(2))
    return offs_m, mine, tl.max(mine.to(tl.int32), axis=0) > 0


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, s_ptr, slots_ptr, T, K, SR,
                   stride_xt, stride_al, stride_ar, stride_st,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_r, lora = tl.program_id(1), tl.program_id(2)
    offs_m, mine, any_mine = _own_rows(slots_ptr, T, BLOCK_M)
    if any_mine:
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_in = offs_r < SR
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        x_rows = x_ptr + offs_m[:, None] * stride_xt
        a_cols = a_ptr + lora * stride_al + offs_r[None, :] * stride_ar
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_in = k < K
            x = tl.load(x_rows + k[None, :], mask=mine[:, None] & k_in[None, :], other=0.0)
            a = tl.load(a_cols + k[:, None], mask=k_in[:, None] & r_in[None, :], other=0.0)
            acc = tl.dot(x.to(DOT_DTYPE), a.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        out = s_ptr + offs_m[:, None] * stride_st + offs_r[None, :]
        tl.store(out, acc.to(s_ptr.dtype.element_ty), mask=mine[:, None] & r_in[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, slots_ptr, scale_ptr, starts_ptr, T, N, R,
                   stride_st, stride_bl, stride_bn, stride_yt, stride_scale,
                   NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_n, lora = tl.program_id(1), tl.program_id(2)
    offs_m, mine, any_mine = _own_rows(slots_ptr, T, BLOCK_M)
    if any_mine:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        r_in = offs_r < R
        delta = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(NUM_SLICES):  # a column belongs to one slice: the others add nothing to it
            n_lo = tl.load(starts_ptr + j)
            n_hi = tl.load(starts_ptr + j + 1)
            n_in = (offs_n >= n_lo) & (offs_n < n_hi)
            if tl.max(n_in.to(tl.int32), axis=0) > 0:
                s = tl.load(s_ptr + offs_m[:, None] * stride_st + (j * R + offs_r)[None, :],
                            mask=mine[:, None] & r_in[None, :], other=0.0)
                b = tl.load(b_ptr + lora * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None],
                            mask=r_in[:, None] & n_in[None, :], other=0.0)
                part = tl.dot(s.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=DOT_PRECISION)
                part = part.to(y_ptr.dtype.element_ty).to(tl.float32)  # the expanded product in the model dtype
                scale = tl.load(scale_ptr + lora * stride_scale + j)
                delta += tl.where(n_in[None, :], part * scale, 0.0)
        y_tile = y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :]
        keep = mine[:, None] & (offs_n < N)[None, :]
        y = tl.load(y_tile, mask=keep, other=0.0)
        delta = delta.to(y_ptr.dtype.element_ty)  # rounded like PEFT's ``lora_B(...) * scaling``
        tl.store(y_tile, (y.to(tl.float32) + delta.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=keep)


def lora_add_single_pass(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                    slots: torch.Tensor, starts: torch.Tensor) -> None:
    """In place: ``y[t, slice j] += scale[l, j] * (x[t] @ A[l, jR:(j+1)R].T) @ B[l, slice j].T`` for
    every row t with ``slots[t] == l >= 0``. Shapes: x [T, K], y [T, N], A [L, S*R, K], B [L, N, R],
    scale [L, S] float32, slots [>= T] int32, starts [S + 1] int32 (slice j: columns
    ``starts[j]:starts[j+1]`` of y)."""
    T, K = x.shape
    L, SR, _ = a.shape
    N, R = b.shape[1], b.shape[2]
    S = SR // R
    if T == 0:
        return
    x = x.contiguous()
    s = torch.empty(T, SR, dtype=x.dtype, device=x.device)
    dot = dot_args(_shrink_kernel, x.dtype)
    block_m = 16
    block_r = min(64, max(16, triton.next_power_of_2(SR)))
    _shrink_kernel[(triton.cdiv(T, block_m), triton.cdiv(SR, block_r), L)](
        x, a, s, slots, T, K, SR, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64, **dot)
    block_n = 64
    _expand_kernel[(triton.cdiv(T, block_m), triton.cdiv(N, block_n), L)](
        s, b, y, slots, scale, starts, T, N, R, s.stride(0), b.stride(0), b.stride(1), y.stride(0), scale.stride(0),
        NUM_SLICES=S, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(R)), **dot)
