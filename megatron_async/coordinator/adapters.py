"""LoRA adapters across the coordinator's engines (docs/LORA.md): which engines hold which
adapter, learnt from their registration and from their answers to ``load_lora_adapter`` /
``unload_lora_adapter``. A request naming an adapter (its sampling map's ``lora``) is routed only
among the engines that hold it (the routing policy picks among them, the least loaded by
default); one that no engine holds is refused alone, and the others keep being served.

Both operations run on the engines an ``engines`` argument names (their indexes), else a load on
every live engine and an unload on every engine that holds the adapter (none: a 404). Each engine's answer carries the adapters it holds afterwards (``"loras"``, whatever the
outcome: dp_engine/link_controls.py), so the table follows what the engines did, not what was
asked. An unload takes the adapter off its engines' entries as it is sent, so that no request for
it is routed there while they unload it; an engine that refuses (its adapter still in use) gives it
back with its answer. Clients are told the union of the engines' adapters (``info["loras"]``)
whenever it changes: a server in front of the coordinator answers a ``model`` that no engine holds
with a 404 and lists the adapters in /v1/models."""
from __future__ import annotations

from typing import Any

from megatron_async.coordinator.engines import EngineSlot

LORA_OPS = frozenset({"load_lora_adapter", "unload_lora_adapter"})


def adapter_of(sampling: Any) -> str | None:
    """The adapter a request names (None: the base model); its kind is its engine's to check."""
    name = sampling.get("lora") if isinstance(sampling, dict) else getattr(sampling, "lora", None)
    return name if isinstance(name, str) else None


class AdapterRouting:
    """Mixed into ``CoordinatorCore``: uses its engines, requests, clients, counts and outbox."""

    _adapters_told: tuple[str, ...] = ()

    def adapters(self) -> list[str]:
        """Every adapter some live engine holds, by name."""
        return sorted(set().union(*(s.loras for s in self.engines.live())))

    def adapter_candidates(self, name: str | None, candidates: list[EngineSlot]) -> list[EngineSlot]:
        return candidates if name is None else [s for s in candidates if name in s.loras]

    def refuse_unheld(self, req, name: str) -> None:
        """``req`` names an adapter that none of the engines taking requests holds."""
        self.counts["no_adapter"] += 1
        self.requests.end(req.rid)
        self._tell(req, "rejected", req.client_rid,
                   f"SamplingParams.lora={name!r}: no engine holds this LoRA adapter (loaded: {self.adapters()}); "
                   "load it with load_lora_adapter")

    def lora_control(self, client: Any, op_id: int, op: str, args: dict, targets: list[EngineSlot] | None) -> None:
        """``op`` on ``targets`` (None: a load on every live engine, an unload on its holders)."""
        live = self.engines.live()
        name = args.get("lora_name")
        if targets is None and op == "unload_lora_adapter":  # (the others would each answer 404)
            targets = [s for s in live if name in s.loras]
            if not targets:
                self.outbox.to_client(client, "control_done", op_id, 404,
                                      {"error": f"no engine holds LoRA adapter {name!r} (loaded: {self.adapters()})"})
                return
        if op == "unload_lora_adapter":
            for slot in targets:
                slot.loras.discard(name)
            self.adapters_changed()
        self._broadcast(client, op_id, op, args, targets)

    def engine_adapters(self, slot: EngineSlot, body: Any) -> None:
        """An engine's answer that says which adapters it holds now."""
        loras = body.get("loras") if isinstance(body, dict) else None
        if isinstance(loras, list) and all(isinstance(n, str) for n in loras):
            slot.loras = set(loras)
            self.adapters_changed()

    def adapters_changed(self) -> None:
        """Tell the clients the engines' adapters when their union changed."""
        now = tuple(self.adapters())
        if now != self._adapters_told:
            self._adapters_told = now
            for client in self.clients:
                self.outbox.to_client(client, "info", self.info())
