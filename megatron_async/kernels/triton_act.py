"""SiLU-and-mul of a fused gate_up projection in one kernel, and NemotronH's relu(h)^2.

Rounds like ``F.silu(gate) * up`` in the activation dtype: silu in float32 rounded to the
dtype, then the product rounded again (exp may differ from torch's by a float32 ulp).
``relu_square`` rounds like ``torch.relu(h).square()``: the square of a bf16 / fp16 value is
exact in float32, so one rounding gives torch's bits."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up, dt: tl.constexpr):
    """silu(gate) * up from float32 gate / up as the torch ops round: silu rounded to ``dt``,
    then the product rounded to ``dt`` (shared with the fused SwiGLU GEMM's epilogue)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    return (act * up).to(dt)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + tok * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + tok * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * I + offs, silu_mul(gate, up, dt), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate columns first, then up; unit last stride) -> silu(gate) * up, [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_and_mul takes a [T, 2I] tensor with unit last stride, got {tuple(gate_up.shape)}")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), I=inter, BLOCK=block, num_warps=4
    )
    return out


@triton.jit
def relu_sq(h, dt: tl.constexpr):
    """relu(h)^2 from float32 h, rounded to ``dt`` as torch rounds it."""
    r = tl.maximum(h, 0.0)
    return (r * r).to(dt)


@triton.jit
def _relu_square_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    h = tl.load(x_ptr + tok * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * I + offs, relu_sq(h, out_ptr.dtype.element_ty), mask=mask)


def relu_square(h: torch.Tensor) -> torch.Tensor:
    """[T, I] (unit last stride) -> relu(h)^2, [T, I]: one kernel where torch runs two."""
    if h.dim() != 2 or h.stride(1) != 1:
        raise ValueError(f"relu_square takes a [T, I] tensor with unit last stride, got {tuple(h.shape)}")
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if out.numel() == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(h.shape[1]))
    _relu_square_kernel[(h.shape[0], triton.cdiv(h.shape[1], block))](h, out, h.stride(0), I=h.shape[1], BLOCK=block,
                                                                     num_warps=4)
    return out
