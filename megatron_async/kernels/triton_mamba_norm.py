"""Mamba2's gated group RMSNorm in one Triton pass: the SSM output y (float32), the gate z (a
strided view of in_proj's output) and the norm weight in, out_proj's input in the model dtype
out. The semantics of ``mamba2_mixer.gated_rms_norm`` then ``.to(dtype)``, which as torch ops
costs about a dozen small elementwise / reduction kernels per layer and step.

One program per (token, group): a token's groups never mix, so each output depends on its own
row only (batch-invariant, the same on decode and mixed steps). Grids depend only on shapes.
Runs on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported), for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_mamba_decode import exact_exp


@triton.jit
def _gated_norm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, group_size, eps,
    stride_yt, stride_yc, stride_zt, stride_zc, stride_ot,
    BLOCK: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < group_size
    cols = tl.program_id(1) * group_size + offs
    y = tl.load(y_ptr + token * stride_yt + cols * stride_yc, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + token * stride_zt + cols * stride_zc, mask=mask, other=0.0).to(tl.float32)
    gate = z / (1.0 + exact_exp(-z))  # torch's silu
    if not NORM_BEFORE_GATE:
        y = y * gate
    y = y * tl.rsqrt(tl.sum(y * y, axis=0) / group_size + eps)
    y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_BEFORE_GATE:
        y = y * gate
    tl.store(out_ptr + token * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, norm_before_gate: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y / z [T, I] (any strides), weight [I] -> [T, I] contiguous in ``out_dtype``: RMSNorm over
    each group of ``group_size`` channels, gated by silu(z) after the norm (``norm_before_gate``)
    or before it; float32 inside."""
    T, I = y.shape
    if z.shape != y.shape or weight.shape != (I,) or I % group_size != 0:
        raise ValueError(f"gated norm: y {tuple(y.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}, "
                         f"group size {group_size}")
    out = torch.empty(T, I, dtype=out_dtype, device=y.device)
    if T == 0:
        return out
    block = triton.next_power_of_2(group_size)
    _gated_norm_kernel[(T, I // group_size)](
        y, z, weight.contiguous(), out, group_size, eps,
        *y.stride(), *z.stride(), out.stride(0),
        BLOCK=block, NORM_BEFORE_GATE=norm_before_gate, num_warps=max(1, min(8, block // 256)),
    )
    return out
