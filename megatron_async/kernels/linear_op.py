"""The one linear op every layer calls: ``F.linear`` by default, the batch-invariant Triton
matmul when the step asks for batch-invariant numerics (``ForwardBatch.batch_invariant``).

The mode is an argument, never process state: the same model serves both modes, and the
default path is exactly ``F.linear`` (one bool test of overhead)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias``. ``batch_invariant``: each row's bits are independent of how
    many rows ``x`` has (fixed tiles, fixed K order; see triton_invariant_matmul)."""
    if not batch_invariant:
        return F.linear(x, weight, bias)
    return _invariant_linear()(x, weight, bias)


@functools.cache
def _invariant_linear():
    # imported on first use: tests set TRITON_INTERPRET before the kernels are decorated
    from megatron_async.kernels.triton_invariant_matmul import invariant_linear

    return invariant_linear
