"""The one block system of every model family: a stack of pre-norm residual blocks
``h += mixer(norm(h))``, the mixer being attention, Mamba2, an MLP or a mixture of experts.

Each residual add is fused with the next block's norm (``RMSNorm.add_and_norm``: one kernel
on CUDA), so a block takes the previous mixer's output and the residual stream before it,
and the sums round exactly as ``h = h + mixer(norm(h))`` does. Under tensor parallelism the
mixer's output projection (row-parallel) may leave its all-reduce to that norm too
(``PendingSum``): one kernel sums the ranks' partials, adds the residual and normalises. A
MoE mixer may leave its experts' slot sum the same way (``PendingCombine``), and on one GPU a
decode-size output projection the sum of its K-split partials (``PendingSplitSum``). All are
``DeferredSum``s: every consumer of a block's output is a norm (the next block's, the final
norm, an MTP head's), and anything else must call ``reduce()``. A mixer whose input goes only
into an FP8 linear (``fp8_input_linear``) may get it from its norm as e4m3 rows with their scales
(``QuantizedRows``), where that linear would otherwise quantize them in a pass of its own."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_async.forward_batch import ForwardBatch
from megatron_async.kernels import fused_ops
from megatron_async.kernels.backends import KernelBackends
from megatron_async.models.layers.mamba_step_plan import MambaStepPlan
from megatron_async.models.layers.norm import RMSNorm
from megatron_async.parallel.linear import RowParallelLinear

OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "out_proj")
"""Names of the mixers' last layer (attention, MLP, Mamba2) when it is row-parallel and the
mixer returns its output unchanged: such an output may stay a ``PendingSum`` until the next
norm. A mixer that post-processes that output must not use these names (a PendingSum is not
a tensor: misuse fails loudly). A mixer with a ``defer_reduction`` flag of its own (MoE)
decides itself when its output may stay deferred."""


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
    kernels: KernelBackends = KernelBackends()
    """The model's kernels (``CausalLM.kernels``)."""
    routed_experts: torch.Tensor | None = None
    """``ForwardBatch.routed_experts`` for the model's own layers (None in MTP heads)."""


class Block(nn.Module):
    def __init__(self, norm: RMSNorm, mixer: nn.Module):
        super().__init__()
        self.norm = norm
        self.mixer = mixer
        for name in OUTPUT_PROJECTIONS:
            proj = getattr(mixer, name, None)
            if type(proj) is RowParallelLinear:
                proj.defer_reduction = True
        if hasattr(mixer, "defer_reduction"):
            mixer.defer_reduction = True

    def _quantizes_input(self, rows: int, fused: bool) -> bool:
        """Whether the norm hands the mixer ``rows`` quantized for its FP8 input linear."""
        # a mixer class without the property has none; one with it must answer (no getattr default
        # that would swallow an AttributeError raised inside it)
        linear = self.mixer.fp8_input_linear if hasattr(type(self.mixer), "fp8_input_linear") else None
        w = self.norm.weight
        return fused_ops.fp8_input_prequantized(rows, w.dtype, w.device, linear, fused)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous mixer's output (maybe a ``DeferredSum``), or the embeddings when
        ``residual`` is None. Returns (this mixer's output, the residual stream before it)."""
        inv, fused = step.batch.batch_invariant, step.kernels.fused
        quantize = not inv and self._quantizes_input((x if residual is None else residual).shape[0], fused)
        if residual is None:
            h, residual = self.norm(self.norm.in_dtype(x), inv, fused, quantize), x
        else:
            h, residual = self.norm.add_and_norm(x, residual, inv, fused, quantize)
        return self.mixer(h, step), residual
