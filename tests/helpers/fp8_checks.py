"""Checks shared by the FP8 kernel tests (CPU interpreter and GPU)."""
from __future__ import annotations

import torch

from megatron_async.kernels import fp8_quant as fq


def check_gemm(out: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, sbn: int = 128, bias=None,
               ulps: float = 1.0, slack: float = 2.0 ** -20) -> torch.Tensor:
    """|out - ref| <= ``ulps`` of out's dtype at |ref| + ``slack`` x sum |terms| (another summation
    order; on the GPU, the FP8 tensor core's accumulation inside a group)."""
    x, q, s = x.cpu(), q.cpu(), s.cpu()
    bias = None if bias is None else bias.cpu()
    ref = fq.fp8_linear_reference(x, q, s, bias, sbn, out_dtype=torch.float32)
    xq, xs = fq.quantize_activation(x)
    mag = fq.dequantize_activation(xq, xs).abs() @ fq.dequantize_weight(q, s, sbn).abs().T
    tol = ulps * torch.finfo(out.dtype).eps * ref.abs() + slack * mag + 1e-30
    err = (out.float().cpu() - ref).abs()
    assert bool((err <= tol).all()), f"max err {err.max():.3g}, worst ratio {(err / tol).max():.3g}"
    return err
