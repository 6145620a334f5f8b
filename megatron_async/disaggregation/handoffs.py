"""The coordinator's side of the prefill -> decode hand-off: one ``Transfer`` per request between
its prefill engine's first token and its decode engine's import, its decode engine chosen by
load, the pair connections' rendezvous, and what an engine's death or a client's abort does to a
transfer (docs/DISAGGREGATION.md). No torch: it runs in the coordinator.

States of a transfer: PLACING (no decode engine takes it yet: it waits, at most
``unrouted_timeout_s``; with no decode engine left at all, its prefill engine decodes it itself) -> IMPORTING (kv_import sent; the decode engine allocates its blocks, or
defers while it has no room) -> SENDING (kv_accepted: the receive is posted; kv_send told the
prefill engine) -> gone at kv_imported (the request runs on the decode engine; the prefill
engine frees its blocks: kv_release) or kv_failed (the request ends with "error").

A client's abort ends the request at once; its transfer runs on without it (a posted receive
must be matched) and ends with the decode engine aborting the import and the prefill engine
freeing its blocks. A decode engine that dies: its transfers are placed again (the prefill
engine still holds the blocks). A prefill engine that dies: the decode engine drops the import
(kv_cancel); the request ends as a dead engine's do (core.py)."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from megatron_async.coordinator.adapters import adapter_of
from megatron_async.coordinator.engines import EngineSlot, EngineState
from megatron_async.coordinator.requests import OpenRequest

PLACING, IMPORTING, SENDING = "placing", "importing", "sending"


@dataclass(eq=False)
class Transfer:
    rid: int
    req: OpenRequest | None
    """None once the request ended (a client's abort): the transfer completes, then is undone."""
    prefill: EngineSlot
    blocks: int
    version: int
    decode: EngineSlot | None = None
    key: str = ""
    """The pair key its kv_import carried: its kv_send carries the same one, even if the pair was
    given a new key meanwhile (its receive waits on this one's connection)."""
    state: str = PLACING
    since: float = field(default_factory=time.monotonic)


class HandOffs:
    def __init__(self, core):
        """``core``: the ``CoordinatorCore`` (its outbox, requests, engines, counts)."""
        self.core = core
        self.transfers: dict[int, Transfer] = {}
        self._pair_keys: dict[tuple[int, int], str] = {}

    # ---------------------------------------------------------------- routing
    def route_kind(self, slot: EngineSlot) -> str:
        """A new request goes to a prefill engine as "prefill" while a decode engine is live; else
        (and to mixed engines) as "route": served there from prompt to end."""
        return "prefill" if slot.role == "prefill" and self.core.engines.decoders() else "route"

    def _pair(self, prefill: EngineSlot, decode: EngineSlot, rank: int, key: str = "") -> tuple[str, str, int, str]:
        """The pair spec of (``prefill``, ``decode``) for ``rank``: on ``key``, else the pair's key."""
        if decode is prefill:
            return "local", "", rank, "local"
        key = key or self._pair_keys.get((prefill.index, decode.index))
        if key is None:
            key = self._pair_keys[prefill.index, decode.index] = \
                f"kv-{prefill.index}-{decode.index}-{secrets.token_hex(16)}"
        backends = {prefill.info.kv_backend, decode.info.kv_backend}
        backend = backends.pop() if len(backends) == 1 else "gloo"
        return key, decode.info.kv_address, rank, backend

    def _choose(self, t: Transfer) -> EngineSlot | None:
        """The decode engine whose prefix cache holds the most leading blocks of the prompt (as the
        coordinator's view says: those are not sent again), then the one with the largest share of
        free request slots, among those that can hold the blocks (ties: the one registered
        first); None when none can. Only decode engines that hold the request's LoRA adapter
        count (coordinator/adapters.py). With no such decode engine, the prefill engine itself (it
        decodes the request with the blocks it kept)."""
        decoders = self.core.engines.decoders()
        if t.req is not None:
            decoders = self.core.adapter_candidates(adapter_of(t.req.sampling), decoders)
        if not decoders:
            return t.prefill if t.prefill.state is not EngineState.GONE else None
        keys = t.req.keys if t.req is not None else []
        holders = sum(1 << s.index for s in decoders if s.affinity)
        depths = self.core.view.depths(keys, holders) if keys and holders else {}
        best, best_score = None, None
        for slot in decoders:
            if slot.pending >= slot.max_requests or (slot.free_blocks and slot.free_blocks < t.blocks):
                continue
            score = (depths.get(slot.index, 0), (slot.max_requests - slot.pending) / slot.max_requests)
            if best_score is None or score > best_score:
                best, best_score = slot, score
        return best

    def _place(self, t: Transfer) -> None:
        slot = self._choose(t)
        if slot is None:
            t.state, t.decode = PLACING, None
            return
        t.decode, t.state, t.since = slot, IMPORTING, time.monotonic()
        slot.pending += 1
        slot.submitted += 1
        req = t.req
        self.core.counts["kv_imports"] += 1
        if req is None:  # (ended while placed again: nothing to import)
            self._drop(t, release=True)
            return
        if slot.affinity and req.keys:  # its prompt's blocks will be in that engine's prefix cache
            self.core.view.assign(slot.index, req.keys, slot.submitted)
        reply = None if req.stream else self.core.replies.get(req.client)
        pair = self._pair(t.prefill, slot, 1)
        t.key = pair[0]
        self.core.outbox.to_engine(slot, "kv_import", t.rid, slot.submitted, req.prompt, req.sampling, req.stream,
                                   req.digests, None if reply is None else (reply, req.client_rid), req.tokens,
                                   req.log_probs, t.version, t.blocks, pair)

    def place_waiting(self) -> None:
        """A decode engine joined (or room was freed): transfers waiting for one are placed."""
        for t in list(self.transfers.values()):
            if t.state == PLACING:
                self._place(t)

    def _drop(self, t: Transfer, release: bool = False, cancel: bool = False) -> None:
        """Forget ``t``: the prefill engine frees its blocks (``release``), the decode engine its
        pending import (``cancel``)."""
        self.transfers.pop(t.rid, None)
        if t.decode is not None:
            t.decode.pending -= 1
            if cancel and t.decode.state is not EngineState.GONE:
                self.core.outbox.to_engine(t.decode, "kv_cancel", t.rid)
        if release and t.prefill.state is not EngineState.GONE:
            self.core.outbox.to_engine(t.prefill, "kv_release", t.rid)

    # ---------------------------------------------------------------- engine messages
    def kv_ready(self, slot: EngineSlot, rid: int, blocks: int, version: int) -> None:
        req = self.core.requests.get(rid)
        if req is None or req.engine is not slot or rid in self.transfers:
            self.core.outbox.to_engine(slot, "kv_release", rid)  # nobody waits for it
            return
        t = self.transfers[rid] = Transfer(rid, req, slot, blocks, version)
        self._place(t)

    def kv_accepted(self, slot: EngineSlot, rid: int, cached: int = 0) -> None:
        t = self.transfers.get(rid)
        if t is None or t.decode is not slot or t.state != IMPORTING:
            return  # cancelled meanwhile (kv_cancel is on its way)
        t.state = SENDING
        self.core.counts["kv_cached_blocks"] += cached
        self.core.outbox.to_engine(t.prefill, "kv_send", rid, self._pair(t.prefill, slot, 0, t.key), cached)

    def kv_shared(self, slot: EngineSlot, rid: int, payload: dict) -> None:
        """An "ipc" pair's blocks, shared by the prefill engine: passed on to the decode engine."""
        t = self.transfers.get(rid)
        if t is not None and t.prefill is slot and t.state == SENDING and t.decode is not None:
            self.core.outbox.to_engine(t.decode, "kv_shared", rid, payload)

    def kv_imported(self, slot: EngineSlot, rid: int, blocks: int) -> None:
        t = self.transfers.get(rid)
        if t is None or t.decode is not slot:
            self.core.outbox.to_engine(slot, "abort", rid)  # an import nobody waits for
            return
        self.transfers.pop(rid)
        slot.kv_received_blocks += blocks
        t.prefill.kv_sent_blocks += blocks
        self.core.counts["kv_handoffs"] += 1
        if t.prefill.state is not EngineState.GONE:
            self.core.outbox.to_engine(t.prefill, "kv_release", rid)
        req = t.req
        if req is None or self.core.requests.get(rid) is not req:
            slot.pending -= 1
            self.core.outbox.to_engine(slot, "abort", rid)
            return
        self.core.requests.unplace(req)  # off the prefill engine; the decode engine's pending counted it
        req.engine = slot

    def kv_failed(self, slot: EngineSlot, rid: int, message: str) -> None:
        t = self.transfers.get(rid)
        if t is None or slot not in (t.prefill, t.decode):
            return
        self.core.counts["kv_failed"] += 1
        pair = (t.prefill.index, t.decode.index) if t.decode is not None else None
        if pair is not None and self._pair_keys.get(pair) == t.key:  # (a broken or refused connection: its key is
            del self._pair_keys[pair]  # spent; a later failure on that key leaves the pair's new one alone)
        self._drop(t, release=True, cancel=slot is t.prefill)
        if t.req is not None and self.core.requests.get(rid) is t.req:
            decode = "?" if t.decode is None else t.decode.index
            self.core.end_with_error(t.req, f"KV transfer from engine {t.prefill.index} to engine {decode} failed: "
                                            f"{message}")

    # ---------------------------------------------------------------- aborts, deaths, time
    def abort(self, req: OpenRequest) -> bool:
        """A client's abort of a request in transfer: it ends now (True); False: not in transfer."""
        t = self.transfers.get(req.rid)
        if t is None or t.req is not req:
            return False
        t.req = None
        if t.state == PLACING:
            self._drop(t, release=True)
        return True

    def engine_gone(self, slot: EngineSlot) -> None:
        """Before its requests are ended or routed again (core._remove): transfers from a dead
        prefill engine are cancelled at their decode engine; those to a dead decode engine are
        placed on another one."""
        for t in list(self.transfers.values()):
            if t.prefill is slot:
                self._drop(t, cancel=True)
            elif t.decode is slot:
                t.decode = None
                self.core.counts["kv_replaced"] += 1
                if t.req is None:
                    self._drop(t, release=True)
                else:
                    self._place(t)

    def tick(self, now: float, timeout_s: float) -> None:
        for t in list(self.transfers.values()):
            if t.state == PLACING and now - t.since > timeout_s:
                self._drop(t, release=True)
                if t.req is not None and self.core.requests.get(t.rid) is t.req:
                    self.core.end_with_error(t.req, f"no decode engine took it within {timeout_s:.0f} s")

    def describe(self) -> dict[str, Any]:
        states: dict[str, int] = {}
        for t in self.transfers.values():
            states[t.state] = states.get(t.state, 0) + 1
        return states
