"""RMSNorm with Hugging Face numerics: normalise in float32, then scale, with the pre-norm
residual add fused in (one Triton kernel on CUDA; the torch code is the reference)."""
from __future__ import annotations

import torch
from torch import nn

from megatron_async.kernels import fused_ops
from megatron_async.kernels.deferred_sum import DeferredSum


class RMSNorm(nn.Module):
    cast_before_weight = True
    """LlamaRMSNorm: cast the normalised activations back to their dtype, then multiply by the
    weight, so bf16 results round exactly like the reference."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, batch_invariant: bool = False, fused: bool = True, quantize: bool = False):
        """``fused``: the model's ``KernelBackends.fused`` (the Triton kernel on CUDA tensors).
        ``quantize``: the rows as e4m3 + group scales for an FP8 linear (``QuantizedRows``) where
        the fused kernel takes x; else a tensor."""
        # The Triton kernel reduces each row in one program, alone: batch-invariant mode
        # always takes it (torch's reductions pick their split from the whole tensor).
        if (batch_invariant or fused_ops.use_fused(x, fused)) and x.dtype == self.weight.dtype:
            if quantize and self._quantizes(x):
                return fused_ops.rms_norm_quantized(x, None, self.weight, self.eps, self.cast_before_weight)[0]
            return fused_ops.rms_norm(x, self.weight, self.eps, self.cast_before_weight)
        return self._torch(x)

    def _quantizes(self, x: torch.Tensor) -> bool:
        """Whether the quantizing norm kernel takes x: [T, hidden] rows of at least one 128-wide group."""
        return x.dim() == 2 and x.shape[1] >= 128

    def add_and_norm(self, x: torch.Tensor | DeferredSum, residual: torch.Tensor, batch_invariant: bool = False,
                     fused: bool = True, quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm residual step, one kernel when fused.
        The sum is rounded to the residual stream's dtype (float32 for Mamba2's
        ``residual_in_fp32``), then cast to the weight's dtype and normalised. ``x`` may be a
        mixer's ``DeferredSum`` (a row-parallel layer's TP all-reduce, the MoE slot sum): its
        sum then joins the same kernel where one takes these tensors, else it is reduced first.
        ``quantize``: as in ``forward``, the first output may be ``QuantizedRows`` (not where a
        ``DeferredSum``'s own kernel takes the sum: that norm's output stays a tensor)."""
        if isinstance(x, DeferredSum):
            done = x.add_rms_norm(residual, self.weight, self.eps, self.cast_before_weight)
            if done is not None:
                return done
            x = x.reduce()
        if (batch_invariant or fused_ops.use_fused(x, fused)) and x.dtype == residual.dtype == self.weight.dtype:
            if quantize and self._quantizes(x):
                return fused_ops.rms_norm_quantized(x, residual, self.weight, self.eps, self.cast_before_weight)
            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps, self.cast_before_weight)
        residual = x + residual
        return self(self.in_dtype(residual), batch_invariant, fused, quantize), residual

    def in_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """x in the weight's dtype (a float32 residual stream is cast down before the norm)."""
        return x if x.dtype == self.weight.dtype else x.to(self.weight.dtype)


class NemotronRMSNorm(RMSNorm):
    """NemotronH scales in float32 before casting back (LlamaRMSNorm casts first)."""

    cast_before_weight = False

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)
