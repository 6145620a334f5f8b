"""The interface every model offers the engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from megatron_async.forward_batch import ForwardBatch
from megatron_async.kernels.backends import KernelBackends


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int  # attention layers only
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class MambaStateSpec:
    num_layers: int  # Mamba layers only
    conv_shape: tuple[int, ...]  # per slot: (conv_dim, d_conv - 1)
    ssm_shape: tuple[int, ...]  # per slot: (num_heads, head_dim, d_state)


class CausalLM(nn.Module):
    """A decoder that runs one packed step (prefill chunks and decode tokens mixed).

    Subclasses set ``vocab_size`` and ``eos_token_id`` and implement the methods below."""

    vocab_size: int
    eos_token_id: int | None
    max_position_embeddings: int
    supports_batch_invariant: bool = False
    """Honours ``ForwardBatch.batch_invariant`` and ``compute_logits(batch_invariant=True)``."""
    kernels: KernelBackends = KernelBackends()
    """The kernels this model's layers run (``LLM`` sets it from ``InferenceConfig``): this
    model's own choice, whatever other models of the process run."""
    lora_adapters = None
    """``models.lora.LoRAAdapters`` where LoRA is enabled (``LoRAAdapters.attach``), else None."""

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] int64 -> final hidden states [T, hidden] (after the final norm).

        Writes the step's K/V into ``batch.kv_caches`` and advances Mamba states in place."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool = False, float32: bool = True) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits, float32 unless ``float32=False`` (then the model
        dtype they are computed in); ``batch_invariant``: row-count-independent bits."""
        raise NotImplementedError

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError

    def mamba_state_spec(self) -> MambaStateSpec | None:
        return None

    def routed_experts_shape(self) -> tuple[int, int] | None:
        """(MoE layers, experts per token) of what ``ForwardBatch.routed_experts`` records per
        token; None: the model has no MoE layer (nothing to record)."""
        return None

    def commit_speculative(self, out) -> None:
        """Speculative decoding, after each step's acceptance (``speculative.drafter.VerifyOutputs``,
        on the device, no host reads): models with per-request recurrent state keep the state
        of each row's last accepted position here. Attention-only models need nothing: KV of
        rejected positions is simply overwritten later."""

    def reserve_positions(self, num_positions: int) -> None:
        """Pre-build position tables (rope) up to ``num_positions`` so no step, and no
        captured CUDA graph, ever has to grow them."""

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters; raise ValueError naming any
        missing, unexpected or mis-shaped tensor."""
        raise NotImplementedError
