"""A mixer output whose last sum is left to the next block's norm: the norm
(``RMSNorm.add_and_norm``) asks it to sum, add the residual and normalise in one kernel, and
calls ``reduce`` for the plain tensor where that kernel does not take the tensors. Three kinds:
a row-parallel layer's partial product, summed over the TP group (``communication.PendingSum``),
the grouped-GEMM MoE's expert rows, summed over each token's slots
(``moe_grouped_mm.PendingCombine``), and a decode-size output projection's K-split partials
(``triton_split_linear.PendingSplitSum``). Deliberately not a tensor: any other consumer fails loudly."""
from __future__ import annotations

import torch


class DeferredSum:
    def reduce(self) -> torch.Tensor:
        """The sum, as the mixer would have returned it."""
        raise NotImplementedError

    def add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     cast_before_weight: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(norm(sum + residual), sum + residual) in one kernel, rounded as ``reduce()`` then
        ``RMSNorm.add_and_norm`` (``PendingSplitSum``'s norm reduces its sum of squares in another
        order: a last bit of the normalised rows); or None: no such kernel for these tensors."""
        raise NotImplementedError
