"""What a request's LoRA adapter changes in the context: the adapter slot its tokens carry in the
step snapshot (``lora_slot``, one int32 per token, -1 for the base model) and the prefix-cache key
its blocks are hashed under (the engine's key plus the adapter's name and weights generation), so
blocks computed with one adapter are never hit by a request of another, of the base model, or of
the same adapter after ``update_lora``.

A step where no token has an adapter runs the base model's forward (``skips_free_steps``): the
adapted linears add nothing to a row of slot -1, so skipping their products changes no bits."""
from __future__ import annotations

import functools

from megatron_async.inference.request import DynamicInferenceRequest


def bind_adapter(req: DynamicInferenceRequest, adapters) -> None:
    """At admission: the request's slot and key as the adapter is now (``models.lora.LoRAAdapters``)."""
    name = req.sampling_params.lora
    req.lora_slot, req.lora_key = adapters.slot_of(name), adapters.key_of(name)


@functools.lru_cache(maxsize=1024)
def _joined(base: bytes, lora_key: bytes) -> bytes:
    return base + lora_key


def request_hash_key(base: bytes, req: DynamicInferenceRequest) -> bytes:
    """The key ``req``'s blocks chain from: ``base`` itself for the base model; for an adapter, one
    bytes object per (base, adapter key) pair, so identity checks of adopted digests hold."""
    return _joined(base, req.lora_key) if req.lora_key else base


def adapter_current(req: DynamicInferenceRequest, adapters) -> bool:
    """Whether the adapter's weights are still those ``req`` was admitted with (else its new blocks
    are not published: they hold KV of the adapter's old weights)."""
    return adapters is None or not req.lora_key or (
        req.sampling_params.lora in adapters.loaded and adapters.key_of(req.sampling_params.lora) == req.lora_key)


def skips_free_steps(adapters) -> bool:
    """Whether steps whose rows name no adapter skip the LoRA ops (``StepShape.any_lora`` False).
    Not where experts have adapter slots: their LoRA path is a kernel of its own (other bits than
    the fused MoE, batch-invariant mode included) whose expert-parallel exchanges carry the slots,
    so every rank and every step keeps it."""
    from megatron_async.parallel.expert_lora_slots import ExpertLoRASlots

    return adapters is not None and not any(isinstance(t.slots, ExpertLoRASlots) for t in adapters.targets.values())
