"""RMSNorm with Hugging Face numerics: normalise in float32, cast back, then scale."""
from __future__ import annotations

import torch
from torch import nn

from megatron_async.kernels import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        # The Triton kernel reduces each row in one program, alone: batch-invariant mode
        # always takes it (torch's reductions pick their split from the whole tensor).
        if (batch_invariant or fused_ops.use_fused(x)) and x.dtype == self.weight.dtype:
            return fused_ops.rms_norm(x, self.weight, self.eps)
        # The weight multiplies the already down-cast activations, as LlamaRMSNorm does, so
        # bf16 results round exactly like the reference.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm residual step, one kernel when fused.
        The sum is rounded to the activation dtype before it is normalised."""
        if (batch_invariant or fused_ops.use_fused(x)) and x.dtype == residual.dtype == self.weight.dtype:
            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual, batch_invariant), residual
