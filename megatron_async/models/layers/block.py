"""The one block system of every model family: a stack of pre-norm residual blocks
``h += mixer(norm(h))``, the mixer being attention, Mamba2, an MLP or a mixture of experts.

Each residual add is fused with the next block's norm (``RMSNorm.add_and_norm``: one kernel
on CUDA), so a block takes the previous mixer's output and the residual stream before it,
and the sums round exactly as ``h = h + mixer(norm(h))`` does."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_async.inference.contexts.metadata import ForwardBatch
from megatron_async.models.layers.mamba_step_plan import MambaStepPlan
from megatron_async.models.layers.norm import RMSNorm


@dataclass
class StepInputs:
    """What a mixer may read besides its input: the engine's batch (caches, metadata) and the
    per-step tables the model builds once for all its layers."""

    batch: ForwardBatch
    rope: tuple[torch.Tensor, torch.Tensor] | None
    """(cos, sin) [T, rotary_dim / 2] of every token, or None (no rotary embedding)."""
    mamba_plan: MambaStepPlan | None
    """How the rows split between the Mamba decode and scan paths (None: no Mamba layer)."""
    ep_num_tokens: int | None = None
    """Expert parallelism: the agreed per-rank padded token count of the MoE token exchange
    (``ForwardBatch.ep_num_tokens``); None without expert parallelism."""


class Block(nn.Module):
    def __init__(self, norm: RMSNorm, mixer: nn.Module):
        super().__init__()
        self.norm = norm
        self.mixer = mixer

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous mixer's output, or the embeddings when ``residual`` is None.
        Returns (this mixer's output, the residual stream before it)."""
        if residual is None:
            h, residual = self.norm(self.norm.in_dtype(x)), x
        else:
            h, residual = self.norm.add_and_norm(x, residual)
        return self.mixer(h, step), residual
