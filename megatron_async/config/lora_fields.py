"""The LoRA fields of ``InferenceConfig``: whether the engine serves LoRA adapters beside the base
model and how their slots are sized (how many adapters at once, their largest rank).
``InferenceConfig.lora()`` hands them to the model's adapter slots (models/lora/adapters.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRAFields:
    enable_lora: bool = False
    """Serve LoRA adapters (``LLM.load_lora``, ``SamplingParams.lora``): the attention and MLP
    projections and the MoE layers' experts get adapter slots, sized below, when the LLM is built
    (experts: one pair per expert, docs/LORA.md says what they cost)."""

    max_loras: int = 8
    """``enable_lora``: most adapters loaded at once (one batch may mix all of them and the base)."""

    max_lora_rank: int = 16
    """``enable_lora``: the largest adapter rank accepted (smaller ranks are zero-padded)."""

    lora_grouped_rows: bool = True
    """``enable_lora``: every step groups its tokens by adapter once (on the device, in the step's
    forward) and the attention / MLP LoRA ops run tiles of one adapter each; off: tiles of any
    tokens, each program masking the rows of other adapters (the MoE experts' op always does).
    Grouped, one decode step's LoRA ops on Qwen3-8B at 128 rows over 8 adapters take 2.0 ms against
    4.3 masked (``kernel-times lora``, docs/PERFORMANCE.md)."""

    lora_experts: bool = False
    """``enable_lora``: the MoE layers' routed experts get adapter slots too (one pair per expert and
    slot: ~13 GB for Qwen3-30B-A3B at 8 adapters of rank 16, and every MoE step then runs the grouped
    path with per-pair adapters instead of the fused experts). Off: an adapter naming an expert is
    refused; the attention, dense MLP and shared-expert projections take adapters either way."""
