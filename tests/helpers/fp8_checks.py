"""Checks shared by the FP8 kernel tests (CPU interpreter and GPU)."""
from __future__ import annotations

import torch

from megatron_async.kernels import fp8_quant as fq


def check_gemm(out: torch.Tensor, x, q: torch.Tensor, s: torch.Tensor, sbn: int = 128, bias=None,
               ulps: float = 1.0, slack: float = 2.0 ** -20) -> torch.Tensor:
    """|out - ref| <= ``ulps`` of out's dtype at |ref| + ``slack`` x sum |terms| (another summation
    order; on the GPU, the FP8 tensor core's accumulation inside a group). x: the activation, or its
    rows already quantized (``QuantizedRows``: the reference starts from those)."""
    q, s = q.cpu(), s.cpu()
    bias = None if bias is None else bias.cpu()
    if hasattr(x, "scale"):  # QuantizedRows
        a = fq.dequantize_activation(x.q[:x.m].cpu(), x.scale[:x.m].cpu())
        ref = a @ fq.dequantize_weight(q, s, sbn).T + (0.0 if bias is None else bias.float())
    else:
        x = x.cpu()
        ref = fq.fp8_linear_reference(x, q, s, bias, sbn, out_dtype=torch.float32)
        a = fq.dequantize_activation(*fq.quantize_activation(x))
    mag = a.abs() @ fq.dequantize_weight(q, s, sbn).abs().T
    tol = ulps * torch.finfo(out.dtype).eps * ref.abs() + slack * mag + 1e-30
    err = (out.float().cpu() - ref).abs()
    assert bool((err <= tol).all()), f"max err {err.max():.3g}, worst ratio {(err / tol).max():.3g}"
    return err


class Fp8CallChecks:
    """A stand-in for ``triton_fp8_gemm.fp8_linear`` (monkeypatch it in before the engine is built)
    that checks every call the engine makes, outside CUDA-graph capture, on the engine's own
    activations: the quantize kernel gives the emulation's bits (``fp8_quant.quantize_activation``),
    the other way of getting the A operand (quantized in the GEMM vs pre-quantized, the same tiles)
    gives the same output bits (so the GEMM's in-register quantization is that kernel's too), and
    the output is within ``check_gemm``'s bound of the float32 emulation. Failures are collected
    (``failures``), not raised inside the engine's step; ``rows`` / ``scale_block_ns`` / ``cublas_rows``
    (calls cuBLASLt took: there the A-operand check does not apply) and ``quantized_rows`` (calls
    handed ``QuantizedRows``: only the output is checked, against those rows) say what ran."""

    def __init__(self, ulps: float = 1.0, slack: float = 2.0 ** -20):
        from megatron_async.kernels import triton_fp8_gemm

        self.kernels, self.ulps, self.slack = triton_fp8_gemm, ulps, slack
        self.fp8_linear = triton_fp8_gemm.fp8_linear
        self.rows: list[int] = []
        self.scale_block_ns: set[int] = set()
        self.failures: list[str] = []
        self.cublas_rows: list[int] = []
        self.quantized_rows: list[int] = []
        self.quantized_widths: set[int] = set()
        from megatron_async.kernels.triton_fp8_act import QuantizedRows

        self.rows_type = QuantizedRows

    def __call__(self, x, weight, weight_scale, bias=None, scale_block_n=128, batch_invariant=False, tiles=None,
                 prequantize=None):
        out = self.fp8_linear(x, weight, weight_scale, bias, scale_block_n, batch_invariant, tiles, prequantize)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return out
        if isinstance(x, self.rows_type):  # handed over quantized by its producer: the output against them
            self.rows.append(x.m)
            self.quantized_rows.append(x.m)
            self.quantized_widths.add(x.q.shape[1])
            try:
                check_gemm(out, x, weight, weight_scale, scale_block_n, bias, self.ulps, self.slack)
            except AssertionError as e:
                self.failures.append(f"{x.m} quantized rows -> {weight.shape[0]}: {e}")
            return out
        a = x.reshape(-1, x.shape[-1])
        m, n = a.shape[0], weight.shape[0]
        what = f"{m} x {a.shape[1]} -> {n} (scale_block_n {scale_block_n})"
        self.rows.append(m)
        self.scale_block_ns.add(scale_block_n)
        cublas = tiles is None and prequantize is None and self.kernels.scaled_mm_takes(
            a, weight, weight_scale, scale_block_n, batch_invariant)
        if cublas:
            self.cublas_rows.append(m)
        else:  # the other way of getting the A operand, the same tiles: the same bits
            planned, pre = self.kernels.fp8_tiles(m, n, a.shape[1], x.device, batch_invariant)
            tiles, pre = tiles or planned, pre if prequantize is None else prequantize
            other = self.fp8_linear(x, weight, weight_scale, bias, scale_block_n, batch_invariant, tiles, not pre)
            if not torch.equal(other, out):
                self.failures.append(f"{what}: quantized in the GEMM != pre-quantized")
        q, s = self.kernels.quantize_activation(a)
        rq, rs = fq.quantize_activation(a.cpu())
        if not (torch.equal(q.view(torch.uint8).cpu(), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)):
            self.failures.append(f"{what}: activation bits differ from the emulation's")
        try:
            check_gemm(out.reshape(m, n), a, weight, weight_scale, scale_block_n, bias, self.ulps, self.slack)
        except AssertionError as e:
            self.failures.append(f"{what}: {e}")
        return out
