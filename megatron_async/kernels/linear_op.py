"""The one linear op every layer calls: ``F.linear`` by default, the batch-invariant Triton
matmul when the step asks for batch-invariant numerics (``ForwardBatch.batch_invariant``).

The mode is an argument, never process state: the same model serves both modes, and the
default path is exactly ``F.linear`` (one bool test of overhead).

FP8 weights (e4m3 with ``scale``: 128 x 128 block scales, see fp8_quant): the W8A8 Triton GEMM on
CUDA (and in batch-invariant mode, interpreted on CPU), else the emulated float32 math."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           batch_invariant: bool = False, scale: torch.Tensor | None = None, scale_block_n: int = 128) -> torch.Tensor:
    """``x @ weight.T + bias``. ``batch_invariant``: each row's bits are independent of how
    many rows ``x`` has (fixed tiles, fixed K order; see triton_invariant_matmul). ``scale``:
    the block scales of an e4m3 ``weight`` (``scale_block_n`` weight rows per scale row)."""
    if scale is not None:
        if x.is_cuda or batch_invariant:
            from megatron_async.kernels.triton_fp8_gemm import fp8_linear

            return fp8_linear(x, weight, scale, bias, scale_block_n, batch_invariant)
        from megatron_async.kernels.fp8_quant import fp8_linear_reference

        return fp8_linear_reference(x, weight, scale, bias, scale_block_n)
    if not batch_invariant:
        return F.linear(x, weight, bias)
    return _invariant_linear()(x, weight, bias)


def invariant_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """Batch-invariant ``silu(gate) * up`` of a [gate | up] weight in one kernel, bit-equal to
    ``linear(..., batch_invariant=True)`` then the SiLU-mul; None where that kernel does not take
    the weight (see triton_invariant_matmul.invariant_swiglu).

    On a GPU the default mode's fused kernel (triton_swiglu_matmul) computes it where both take the
    operands: the same k16 tensor-core chain along K in order and the same epilogue, so the same
    bits (H100: equal at 128, 2,048 and 8,192 rows; the ``gpu`` test compares 1- to 8,192-row calls
    of both kernels with the unfused path) in 0.76-0.82x the time (TMA loads, a persistent grid)."""
    from megatron_async.kernels import triton_invariant_matmul as inv

    if x.is_cuda and inv.takes_swiglu(x, weight, bias):
        from megatron_async.kernels.triton_swiglu_matmul import swiglu_linear_if_supported

        out = swiglu_linear_if_supported(x, weight, bias)
        if out is not None:
            return out
    return inv.invariant_swiglu(x, weight, bias)


@functools.cache
def _invariant_linear():
    # imported on first use: tests set TRITON_INTERPRET before the kernels are decorated
    from megatron_async.kernels.triton_invariant_matmul import invariant_linear

    return invariant_linear
