"""The coordinator's control operations (part of ``CoordinatorCore``): a client's operation on
every live engine, answered once all did (controls.py keeps the books); a drain; a shutdown."""
from __future__ import annotations

from typing import Any

from megatron_async.coordinator.adapters import LORA_OPS
from megatron_async.coordinator.controls import CONTROL_OPS, SUBSET_OPS, PendingControl
from megatron_async.coordinator.engines import EngineSlot, EngineState


class ControlOperations:
    """Mixed into ``CoordinatorCore``: uses its engines, controls, clients and outbox."""

    def control(self, client: Any, op_id: int, op: str, args: dict) -> None:
        """``op`` on every live engine (or on those ``args["engines"]`` names: ``SUBSET_OPS``); the
        client is answered once all did."""
        if op not in CONTROL_OPS:
            self.outbox.to_client(client, "control_done", op_id, 400, {"error": f"unknown operation {op!r}"})
            return
        targets = None
        if "engines" in args:
            args = dict(args)
            targets = self.engine_subset(client, op_id, op, args.pop("engines"))
            if targets is None:
                return
        if op in LORA_OPS:  # the adapters' table follows (adapters.py)
            self.lora_control(client, op_id, op, args, targets)
            return
        if targets is not None:
            self._broadcast(client, op_id, op, args, targets)
            return
        if op == "pause_generation":
            self.pause_mode = args.get("mode", "keep")
        elif op == "resume_generation":
            self.pause_mode = None
        elif op == "set_generation_epoch":
            self.generation_epoch = args.get("epoch")
        self._broadcast(client, op_id, op, args)

    def engine_subset(self, client: Any, op_id: int, op: str, wanted: Any) -> list[EngineSlot] | None:
        """The live engines ``wanted`` names (indexes); None once the client was told why not."""
        live = {s.index: s for s in self.engines.live()}
        why, status = None, 400
        if op not in SUBSET_OPS:
            why = f"{op} goes to every engine (engines is for {sorted(SUBSET_OPS)})"
        elif type(wanted) is not list or not wanted or not all(type(i) is int for i in wanted):
            why = f"engines must be a non-empty list of engine indexes, got {wanted!r}"
        elif missing := sorted(set(wanted) - set(live)):
            why, status = f"no live engine {missing} (live: {sorted(live)})", 404
        if why is not None:
            self.outbox.to_client(client, "control_done", op_id, status, {"error": why})
            return None
        return [live[i] for i in sorted(set(wanted))]

    def _broadcast(self, client: Any, op_id: int, op: str, args: dict, targets: list[EngineSlot] | None = None) -> None:
        """``op`` on ``targets`` (None: every live engine)."""
        live = self.engines.live() if targets is None else targets
        if not live:
            self._answer(PendingControl(client, op_id, op, set()))
            return
        internal, _ = self.controls.open(client, op_id, op, [s.index for s in live])
        for slot in live:
            self.outbox.to_engine(slot, "control", internal, op, args)

    def _internal_control(self, slot: EngineSlot, op: str, args: dict) -> None:
        internal, _ = self.controls.open(None, -1, op, [slot.index])
        self.outbox.to_engine(slot, "control", internal, op, args)

    def engine_control_done(self, slot: EngineSlot, internal: int, status: int, body: Any) -> None:
        self.engine_adapters(slot, body)  # (before the answer: its client routes on the new table)
        pc = self.controls.answer(internal, slot.index, status, body)
        if pc is not None:
            self._answer(pc)

    def _answer(self, pc: PendingControl) -> None:
        if pc.client is not None and pc.client in self.clients:
            self.outbox.to_client(pc.client, "control_done", pc.op_id, pc.status, {"engines": pc.answers})

    def drain(self, client: Any, op_id: int, index: int) -> None:
        """Route nothing more to engine ``index``; answered once it left (its requests ended)."""
        slot = self.engines.drain(index)
        if slot is None:
            self.outbox.to_client(client, "control_done", op_id, 404, {"error": f"no engine {index}"})
            return
        self.controls.drains.setdefault(index, []).append((client, op_id))
        self.outbox.to_engine(slot, "drain")

    def shutdown(self, client: Any, op_id: int) -> None:
        """Stop every engine, answer, then the coordinator exits (``done``)."""
        self.stopping = True
        self._shutdown_reply = (client, op_id)
        live = self.engines.live()
        for slot in live:
            slot.state = EngineState.DRAINING
        self._broadcast("coordinator", -1, "stop", {})
        self._check_stopped()

    def _check_stopped(self) -> None:
        if self.stopping and not self.engines.live() and not self.done:
            self.done = True
            client, op_id = self._shutdown_reply
            if client in self.clients:
                self.outbox.to_client(client, "control_done", op_id, 200, {"stopped": True})
