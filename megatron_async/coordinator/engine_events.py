"""The coordinator's engines' events (part of ``CoordinatorCore``): an engine registers, reports a
step's updates and outputs (handed to the clients that asked), heartbeats, leaves, dies or falls
silent; a dead engine's requests are routed again (none of their tokens streamed) or end with
"error" and their partial output, each exactly once."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from megatron_async.coordinator.engines import EngineInfo, EngineSlot, EngineState
from megatron_async.inference.records import CheckedOutput
from megatron_async.inference.request import RequestOutput, RequestUpdate

log = logging.getLogger("megatron_async.coordinator")


class EngineEvents:
    """Mixed into ``CoordinatorCore``: uses its engines, requests, view, hand-offs, clients and outbox."""

    def engine_registered(self, peer: Any, info: EngineInfo) -> EngineSlot:
        """A new engine (RegistrationError: it cannot join): it gets the current pause mode and
        generation epoch, then the requests waiting for an engine."""
        slot = self.engines.register(info, peer)
        log.info("engine %d (%s) registered: %d request slots", slot.index, info.name, info.max_requests)
        self.counts["registered"] += 1
        if self.generation_epoch is not None:
            self._internal_control(slot, "set_generation_epoch", {"epoch": self.generation_epoch})
        if self.pause_mode is not None:
            self._internal_control(slot, "pause_generation", {"mode": self.pause_mode})
        if len(self.engines.slots) == 1:
            for client in self.clients:  # the key space is known now
                self.outbox.to_client(client, "info", self.info())
        self.adapters_changed()
        self._route_unrouted()
        if info.role == "decode":
            self.handoffs.place_waiting()
        return slot

    def _route_unrouted(self) -> None:
        waiting = list(self.requests.unrouted.values())
        self.requests.unrouted.clear()
        for req in waiting:
            if not req.keys:
                req.hashed(self._digests(req.prompt, None, -1))
            self._route([req])

    def engine_heartbeat(self, slot: EngineSlot, load: int, free_blocks: int = 0) -> None:
        slot.last_heard, slot.load, slot.free_blocks = time.monotonic(), load, free_blocks
        self.counts["heartbeats"] += 1

    def engine_outputs(self, slot: EngineSlot, seen_seq: int, updates: Sequence[RequestUpdate],
                       finished: Sequence[RequestOutput | CheckedOutput], rejected: Sequence[tuple[int, str]] = (),
                       failed: Sequence[tuple[int, str]] = (), evicted: Sequence[int] = (), load: int = 0,
                       free_blocks: int = 0, hash_key: bytes | None = None, delivered: Sequence[int] = ()) -> None:
        """One message of an engine: its step's updates and final outputs, requests it refused,
        requests it failed (a step raised: they end with their partial output), the keys of the
        blocks its cache reclaimed (having received submissions up to ``seen_seq``), its
        unfinished request count and obtainable KV blocks, its cache's key when that changed, and
        the requests whose final output it sent their client itself (they end here, untold)."""
        slot.last_heard, slot.load, slot.free_blocks = time.monotonic(), load, free_blocks
        if evicted:
            self.counts["evicted_keys"] += len(evicted)
            self.view.evict(slot.index, evicted, seen_seq)
        if hash_key is not None and self.engines.key_changed(slot, hash_key):
            for client in self.clients:
                self.outbox.to_client(client, "info", self.info())
        streams: dict[Any, list[RequestUpdate]] = {}
        get = self.requests.get
        for upd in updates:
            req = get(upd.request_id)
            if req is None or req.engine is not slot:
                continue
            req.land(upd)
            if req.stream and req.client in self.clients:
                streams.setdefault(req.client, []).append(upd._replace(request_id=req.client_rid))
        for client, batch in streams.items():
            self.outbox.to_client(client, "stream", batch)
        self._finish(slot, finished)
        for rid in delivered:
            req = get(rid)
            if req is not None and req.engine is slot:
                self.requests.end(rid)
                self.counts["delivered_directly"] += 1
        for rid, message in rejected:
            req = get(rid)
            if req is not None and req.engine is slot:
                self.requests.end(rid)
                self._tell(req, "rejected", req.client_rid, message)
        for rid, message in failed:
            req = get(rid)
            if req is not None and req.engine is slot:
                self.requests.end(rid)
                self._tell(req, "finished", [req.partial_output("error", message)])

    def _finish(self, slot: EngineSlot, finished: Sequence[RequestOutput | CheckedOutput]) -> None:
        """Only an output's ``request_id`` is read and set here: the engine's records pass on
        to the clients as they came (messages read them as ``CheckedOutput``)."""
        done: dict[Any, list[RequestOutput | CheckedOutput]] = {}
        for out in finished:
            req = self.requests.get(out.request_id)
            if req is None or req.engine is not slot:
                continue
            self.requests.end(req.rid)
            out.request_id = req.client_rid
            if req.client in self.clients:
                done.setdefault(req.client, []).append(out)
        for client, outs in done.items():
            self.outbox.to_client(client, "finished", outs)

    def engine_left(self, slot: EngineSlot) -> None:
        """It drained (or stopped) and said so: gone, nothing lost."""
        self._remove(slot, died=False)

    def engine_lost(self, slot: EngineSlot) -> None:
        """Its connection closed (its process died or was killed)."""
        if slot.state is not EngineState.GONE:
            log.error("engine %d (%s) lost: %d requests on it", slot.index, slot.name,
                      len(self.requests.on_engine(slot)))
            self._remove(slot, died=True)

    def engine_timed_out(self, slot: EngineSlot, silent_s: float) -> None:
        """It sent nothing for ``silent_s`` (> ``engine_timeout_s``) with its connection open: dead,
        as if the connection had closed. It is told so (``rejected`` -1: it must join again); what
        it sends later is dropped and counted by the transport."""
        if slot.state is EngineState.GONE:
            return
        log.error("engine %d (%s) silent for %.1f s: declared dead with %d requests on it", slot.index, slot.name,
                  silent_s, len(self.requests.on_engine(slot)))
        self.counts["timed_out"] += 1
        self.outbox.to_engine(slot, "rejected", -1, f"declared dead after {silent_s:.1f} s without a message")
        self._remove(slot, died=True, why=f" (no message from it for {silent_s:.0f} s)")

    def _remove(self, slot: EngineSlot, died: bool, why: str = "") -> None:
        """Each request still on it: routed again if it produced nothing yet, else ended with
        "error" and its partial output."""
        self.engines.remove(slot)
        self.handoffs.engine_gone(slot)
        self.adapters_changed()
        message = f"engine {slot.index} ({slot.name}) {'died' if died else 'left'}{why} while this request ran"
        again = []
        for req in self.requests.on_engine(slot):
            if req.tokens:
                self.counts["failed_by_death"] += 1
                self.requests.end(req.rid)
                self._tell(req, "finished", [req.partial_output("error", message)])
            else:
                self.counts["rerouted"] += 1
                self.requests.unplace(req)
                again.append(req)
        for req in again:
            self._route([req])
        for pc in self.controls.engine_gone(slot.index, died):
            self._answer(pc)
        for client, op_id in self.controls.drains.pop(slot.index, []):
            if client in self.clients:
                self.outbox.to_client(client, "control_done", op_id, 200,
                                      {"index": slot.index, "left": not died, "died": died})
        self._check_stopped()
