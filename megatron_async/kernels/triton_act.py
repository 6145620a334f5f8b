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


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate columns first, then up; unit last stride) -> silu(gate) * up, [T, I]."""
    return _activation(gate_up, True)


@triton.jit
def relu_sq(h, dt: tl.constexpr):
    """relu(h)^2 from float32 h, rounded to ``dt`` as torch rounds it."""
    r = tl.maximum(h, 0.0)
    return (r * r).to(dt)


@triton.jit
def _activation_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr):
    """Row ``tok``'s columns: silu(gate) * up of x [T, 2I] (``GATED``) or relu(x)^2 of x [T, I]."""
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    dt = out_ptr.dtype.element_ty
    first = tl.load(x_ptr + tok * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(x_ptr + tok * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
        act = silu_mul(first, up, dt)
    else:
        act = relu_sq(first, dt)
    tl.store(out_ptr + tok * I + offs, act, mask=mask)


def relu_square(h: torch.Tensor) -> torch.Tensor:
    """[T, I] (unit last stride) -> relu(h)^2, [T, I]: one kernel where torch runs two."""
    return _activation(h, False)


def _activation(x: torch.Tensor, gated: bool) -> torch.Tensor:
    if x.dim() != 2 or (gated and x.shape[1] % 2) or x.stride(1) != 1:
        raise ValueError(f"{'silu_and_mul' if gated else 'relu_square'} takes a [T, {'2I' if gated else 'I'}] "
                         f"tensor with unit last stride, got {tuple(x.shape)}")
    num_tokens, inter = x.shape[0], x.shape[1] // (2 if gated else 1)
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    _activation_kernel[(num_tokens, triton.cdiv(inter, block))](x, out, x.stride(0), I=inter, BLOCK=block, GATED=gated,
                                                                 num_warps=4)
    return out
