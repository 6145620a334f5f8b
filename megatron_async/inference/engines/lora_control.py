"""The engine's side of LoRA adapters: a request naming an adapter is checked at ``add_request``,
and ``load`` / ``unload`` / ``update`` change the model's adapter slots between steps.

Unloading an adapter that unfinished requests name is refused (``LoRAError``, nothing changed):
their tokens would otherwise switch weights mid-sequence; abort them or let them finish first.
``update`` rewrites the adapter's slot in place (the copy is ordered after any launch in flight
on the same stream, so that launch ran on the old weights) and bumps the engine's weight version
like a weight update: tokens from the next launch on record the new version. Requests of that
adapter keep their KV (as ``update_weights(recompute_kv=False)``), and its prefix-cache entries
are never hit again (its key names the weights' generation, contexts/lora_rows.py)."""
from __future__ import annotations

from megatron_async.inference.request import InvalidRequestError
from megatron_async.models.lora import LoRAError


def check_request_adapter(name: str | None, adapters) -> None:
    """``SamplingParams.lora`` of a new request: None, or an adapter loaded now."""
    if name is None:
        return
    if adapters is None:
        raise InvalidRequestError(f"SamplingParams.lora={name!r}: this engine serves no LoRA adapters "
                                  "(InferenceConfig.enable_lora)")
    if name not in adapters.loaded:
        raise InvalidRequestError(f"SamplingParams.lora={name!r}: no such adapter is loaded "
                                  f"(loaded: {sorted(adapters.loaded)})")


class LoRAControl:
    def __init__(self, engine):
        """``engine``: the ``DynamicInferenceEngine`` whose model and requests it reads."""
        self.engine = engine

    @property
    def adapters(self):
        adapters = self.engine.context.lora
        if adapters is None:
            raise LoRAError("LoRA adapters need InferenceConfig.enable_lora=True")
        return adapters

    def load(self, name: str, source) -> int:
        """Load adapter ``name`` (``LLM.load_lora``); returns its slot."""
        return self.adapters.load(name, source)

    def update(self, name: str, tensors) -> int:
        """Rewrite adapter ``name`` in place; returns the new weight version."""
        self.adapters.update(name, tensors)
        self.engine.weight_version += 1
        return self.engine.weight_version

    def unload(self, name: str) -> None:
        """Free adapter ``name``; refused while an unfinished request names it."""
        users = sorted(rid for rid, req in self.engine._requests.items() if req.sampling_params.lora == name)
        if users:
            raise LoRAError(f"adapter {name!r} is in use by {len(users)} unfinished requests (ids {users[:8]}): "
                            "abort them or let them finish before unloading it")
        self.adapters.unload(name)
