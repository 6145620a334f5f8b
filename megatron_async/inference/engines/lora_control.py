"""The engine's side of LoRA adapters: a request naming an adapter is checked at ``add_request``,
and ``load`` / ``unload`` / ``update`` change the model's adapter slots between steps. A load's
reading, checking and staging (``prepare``) touches no engine state: ``start_load`` runs it on a
thread of its own and leaves only the install for the engine thread.

Unloading an adapter that unfinished requests name is refused (``LoRAError``, nothing changed):
their tokens would otherwise switch weights mid-sequence; abort them or let them finish first. An
unload otherwise only marks the slot free (no device work); ``last_lora_ms`` times its phases.
``update`` rewrites the adapter's slot in place (the copy is ordered after any launch in flight
on the same stream, so that launch ran on the old weights) and bumps the engine's weight version
like a weight update: tokens from the next launch on record the new version. Requests of that
adapter keep their KV (as ``update_weights(recompute_kv=False)``), and its prefix-cache entries
are never hit again (its key names the weights' generation, contexts/lora_rows.py)."""
from __future__ import annotations

from megatron_async.inference.request import InvalidRequestError
from megatron_async.models.lora import LoRAError
from megatron_async.models.lora.phase_times import PhaseClock
from megatron_async.weight_transfer.pending import PendingTransfer

PREPARE_BOUND_S = 600.0
"""Longest wait for an adapter's preparation where a loop settles before it ended (a follower TP rank)."""


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
        self.preparing: set[str] = set()
        """Names whose ``start_load`` has not finished (a second load of one is refused at its start)."""

    @property
    def adapters(self):
        adapters = self.engine.context.lora
        if adapters is None:
            raise LoRAError("LoRA adapters need InferenceConfig.enable_lora=True")
        return adapters

    def prepare(self, source):
        """Read, check and stage an adapter (``LLM.prepare_lora``): safe on any thread while the
        engine steps; ``load`` of the result then only installs it."""
        return self.adapters.prepare(source)

    def load(self, name: str, source) -> int:
        """Load adapter ``name`` (``LLM.load_lora``); returns its slot."""
        return self.adapters.load(name, source)

    def start_load(self, name: str, source) -> PendingTransfer:
        """``load`` with its prepare on a thread of its own (the engine steps meanwhile): its
        ``finish()``, called between two steps once the prepare ended, installs it. A name taken or
        no free slot is refused now."""
        adapters = self.adapters
        adapters.check_load(name)
        if name in self.preparing:
            raise LoRAError(f"adapter {name!r} is being loaded already")
        self.preparing.add(name)

        def finish(staged, error):
            self.preparing.discard(name)
            if error is not None:
                raise error
            return adapters.load(name, staged)

        return PendingTransfer(f"the preparation of LoRA adapter {name!r}", lambda: adapters.prepare(source), finish,
                               PREPARE_BOUND_S)

    def update(self, name: str, tensors) -> int:
        """Rewrite adapter ``name`` in place; returns the new weight version."""
        self.adapters.update(name, tensors)
        self.engine.weight_version += 1
        return self.engine.weight_version

    def unload(self, name: str) -> None:
        """Free adapter ``name``; refused while an unfinished request names it."""
        clock = PhaseClock()
        users = sorted(rid for rid, req in self.engine._requests.items() if req.sampling_params.lora == name)
        if users:
            raise LoRAError(f"adapter {name!r} is in use by {len(users)} unfinished requests (ids {users[:8]}): "
                            "abort them or let them finish before unloading it")
        clock.lap("users")
        self.adapters.unload(name, clock)
