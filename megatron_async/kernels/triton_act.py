"""SiLU-and-mul of a fused gate_up projection in one kernel.

Rounds like ``F.silu(gate) * up`` in the activation dtype: silu in float32 rounded to the
dtype, then the product rounded again (exp may differ from torch's by a float32 ulp)."""
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
