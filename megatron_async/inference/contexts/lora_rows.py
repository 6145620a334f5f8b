"""What a request's LoRA adapter changes in the context: the adapter slot its tokens carry in the
step snapshot (``lora_slot``, one int32 per token, -1 for the base model) and the prefix-cache key
its blocks are hashed under (the engine's key plus the adapter's name and weights generation), so
blocks computed with one adapter are never hit by a request of another, of the base model, or of
the same adapter after ``update_lora``."""
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
