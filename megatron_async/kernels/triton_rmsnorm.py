"""RMSNorm in one kernel per call, optionally fused with the residual add before it.

Numerics follow the torch layers: float32 statistics, and for the Llama order the
normalised row is rounded to the activation dtype before the weight multiply (itself
rounded), so bf16 results differ from the torch path only by the float32 summation order.
The residual sum is rounded to its dtype before it is normalised, as ``x + residual``
then ``norm(...)`` does."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 16384  # one row lives in registers; wider rows would spill


@triton.jit
def norm_row(x, r, w_ptr, res_out_ptr, row, offs, mask, eps, N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
             CAST_BEFORE_WEIGHT: tl.constexpr, DT: tl.constexpr):
    """One row's RMSNorm in ``DT`` (the output dtype): with ``HAS_RESIDUAL`` x + r first, rounded to
    res_out's dtype and stored there (contiguous rows of N). x is the row in the activation dtype;
    the kernels that make x differently (``triton_moe_combine``) or quantize the result
    (``triton_fp8_act``) share these roundings through it."""
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = xf * rstd
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if CAST_BEFORE_WEIGHT:
        y = y.to(DT).to(tl.float32)
    return (w * y).to(DT)


@triton.jit
def add_norm_row(x, r, w_ptr, out_ptr, res_out_ptr, row, offs, mask, eps, N: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr):
    """``norm_row`` stored in ``out`` (contiguous rows of N)."""
    y = norm_row(x, r, w_ptr, res_out_ptr, row, offs, mask, eps, N, HAS_RESIDUAL, CAST_BEFORE_WEIGHT,
                 out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + offs, y, mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_inner,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
):
    # One program per row; a row is (i0, i1) of a [M0, M1, N] view, so per-head norms of a
    # strided q [T, H, D] need no copy. Outputs are contiguous.
    row = tl.program_id(0).to(tl.int64)
    i0 = row // n_inner
    i1 = row % n_inner
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + i0 * stride_x0 + i1 * stride_x1 + offs, mask=mask, other=0.0)
    r = x
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + i0 * stride_r0 + i1 * stride_r1 + offs, mask=mask, other=0.0)
    add_norm_row(x, r, w_ptr, out_ptr, res_out_ptr, row, offs, mask, eps, N, HAS_RESIDUAL, CAST_BEFORE_WEIGHT)


def num_warps(block: int) -> int:
    """Warps per row program (a function so ``python -m benchmarks kernel-times small-kernels`` can sweep it)."""
    return min(max(block // 512, 1), 16)


def _rows_view(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """(t with a unit last stride, M0, M1, stride0, stride1) for a [.., N] tensor of <= 3 dims."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t, 1, 1, 0, 0
    if t.dim() == 2:
        return t, t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t, t.shape[0], t.shape[1], t.stride(0), t.stride(1)
    raise ValueError(f"rms_norm takes 1 to 3 dims, got shape {tuple(t.shape)}")


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if n > MAX_HIDDEN or weight.shape != (n,) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    x, m0, m1, sx0, sx1 = _rows_view(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out, sr0, sr1 = None, 0, 0
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)}")
        residual, _, _, sr0, sr1 = _rows_view(residual)
        res_out = torch.empty_like(out)
    if out.numel() == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(m0 * m1,)](
        x, x if residual is None else residual, weight, out, out if res_out is None else res_out,
        m1, sx0, sx1, sr0, sr1, eps,
        N=n, BLOCK_N=block, HAS_RESIDUAL=residual is not None, CAST_BEFORE_WEIGHT=cast_before_weight,
        num_warps=num_warps(block),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_before_weight: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim of x ([N], [T, N] or [T, H, N]; any leading strides).

    ``cast_before_weight``: round to x's dtype, then multiply by the weight (Llama / Qwen);
    False scales in float32 first (NemotronH). Returns a contiguous tensor in x's dtype."""
    return _launch(x, None, weight, eps, cast_before_weight)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, cast_before_weight: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) with the sum rounded to x's dtype; new tensors."""
    out, res_out = _launch(x, residual, weight, eps, cast_before_weight)
    assert res_out is not None
    return out, res_out
