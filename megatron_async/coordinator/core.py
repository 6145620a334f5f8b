"""What the coordinator does with each message, independent of sockets: routes requests to
engines, hands engines' updates and outputs to the clients that asked, re-routes or ends the
requests of an engine that died, aborts those of a client that left, and collates control
operations. Its only way out is an ``Outbox`` (the transport's; a test's list).

Messages out (``Outbox.to_engine(slot, kind, *fields)`` / ``to_client(client, kind, *fields)``):
- engine: ``route`` (rid, submission number, prompt, sampling, stream), ``abort`` (rid),
  ``control`` (op id, op, args), ``drain`` ();
- client: ``info`` (dict: block_size, hash_key, key_epoch, engines), ``stream`` ([RequestUpdate]),
  ``finished`` ([RequestOutput]), ``rejected`` (client rid, message), ``control_done`` (op id,
  status, body).
Ids the clients see are their own request ids; engines see the coordinator's."""
from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from megatron_async.config.inference_config import DP_ENGINE_TIMEOUT_S
from megatron_async.config.modes import DpRouting
from megatron_async.coordinator.adapters import AdapterRouting, adapter_of
from megatron_async.coordinator.control_ops import ControlOperations
from megatron_async.coordinator.controls import ControlBook
from megatron_async.coordinator.engine_events import EngineEvents
from megatron_async.coordinator.engines import EngineSlot, EngineTable
from megatron_async.coordinator.requests import OpenRequest, RequestTable, prompt_tokens
from megatron_async.disaggregation.handoffs import HandOffs
from megatron_async.inference.contexts.kv_block_allocator import prefix_digests
from megatron_async.inference.dp_routing import PrefixView, place
UNROUTED_TIMEOUT_S = 60.0
"""How long a request waits for an engine that takes requests (none registered, all draining)."""
ENGINE_TIMEOUT_S = DP_ENGINE_TIMEOUT_S
"""An engine that sent nothing for this long is dead (hung with its connection open), as if its
connection had closed. Engines send a heartbeat every second from a thread of their own, also
while a step runs (dp_engine/link.py)."""


class Outbox(Protocol):
    def to_engine(self, slot: EngineSlot, kind: str, *fields: Any) -> None: ...
    def to_client(self, client: Any, kind: str, *fields: Any) -> None: ...


class CoordinatorCore(EngineEvents, ControlOperations, AdapterRouting):
    def __init__(self, outbox: Outbox, policy: DpRouting | str = DpRouting.LOAD_BALANCED, alpha: float = 0.5,
                 unrouted_timeout_s: float = UNROUTED_TIMEOUT_S, seed: int = 0,
                 engine_timeout_s: float = ENGINE_TIMEOUT_S):
        """``seed``: of the seeds given to requests that bring none (sampling maps without "seed"),
        so that their draws do not depend on the engine they land on (engines started alike would
        draw the same seeds) and a request routed again draws the same tokens."""
        self.outbox = outbox
        self._seeds = random.Random(seed)
        self.policy, self.alpha = DpRouting(policy), float(alpha)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"dp_routing_alpha must be in [0, 1], got {alpha}")
        self.unrouted_timeout_s = unrouted_timeout_s
        if not engine_timeout_s > 0:
            raise ValueError(f"engine_timeout_s must be positive, got {engine_timeout_s}")
        self.engine_timeout_s = float(engine_timeout_s)
        self.view = PrefixView()
        self.engines = EngineTable(self.view)
        self.requests = RequestTable()
        self.controls = ControlBook()
        self.clients: set[Any] = set()
        self.replies: dict[Any, str] = {}
        """client -> the ipc endpoint its engines answer non-streaming requests on (``reply_at``)."""
        self.pause_mode: str | None = None
        """The pause mode clients set last (None: generating): an engine that joins is told it."""
        self.generation_epoch: int | None = None
        self.wire: Callable[[], dict] = dict
        """What the transport dropped and refused (the server's listener counters)."""
        self.stopping = False
        """A shutdown is under way: the transport exits once ``done``."""
        self.done = False
        self._shutdown_reply: tuple[Any, int] | None = None
        self.counts: Counter[str] = Counter()
        """routed, rerouted, failed_by_death, aborted_for_client, evicted_keys, timed_out, ..."""
        self.handoffs = HandOffs(self)
        """Requests between their prefill engine and their decode engine (disaggregation/handoffs.py)."""

    # ------------------------------------------------------------------ clients
    def client_joined(self, client: Any) -> None:
        self.clients.add(client)
        self.outbox.to_client(client, "info", self.info())

    def info(self) -> dict:
        e = self.engines
        return {"block_size": e.block_size or 0, "hash_key": e.hash_key or b"", "key_epoch": e.key_epoch,
                "engines": len(e.live()), "policy": self.policy.value, "loras": self.adapters()}

    def submit(self, client: Any, client_rid: int, prompt: Any, samplings: Sequence[Any], stream: bool,
               digests: bytes | None = None, key_epoch: int = -1) -> None:
        """``len(samplings)`` requests of one prompt (client ids ``client_rid`` on), placed
        together when one engine has room for them all. ``digests``: the prompt's block digests as
        the client computed them with the key of ``key_epoch`` (None or stale: computed here);
        routed on, and passed to the engine so that it does not hash the prompt again."""
        digests = self._digests(prompt, digests, key_epoch)
        group = []
        for i, sampling in enumerate(samplings):
            if isinstance(sampling, dict) and sampling.get("seed") is None:
                sampling = {**sampling, "seed": self._seeds.randrange(2**63)}
            req = self.requests.add(client, client_rid + i, prompt, sampling, stream, digests)
            if req is None:
                self.outbox.to_client(client, "rejected", client_rid + i, "a request with this id is still open")
            else:
                group.append(req)
        self._route(group)

    def _digests(self, prompt: Any, digests: bytes | None, key_epoch: int) -> bytes:
        e = self.engines
        if digests is not None and key_epoch == e.key_epoch:
            return digests
        if isinstance(prompt, str) or e.block_size is None or not e.slots:
            return b""
        self.counts["hashed_here"] += 1
        try:
            return b"".join(prefix_digests(prompt_tokens(prompt), e.block_size, e.hash_key))
        except (TypeError, OverflowError):  # not token ids: the engine refuses it
            return b""

    def _route(self, group: list[OpenRequest]) -> None:
        """Among the engines that take requests and hold the group's LoRA adapter (adapters.py)."""
        if not group:
            return
        names = {adapter_of(req.sampling) for req in group}
        if len(names) > 1:  # (one prompt, several adapters: placed one by one)
            for req in group:
                self._route([req])
            return
        name, candidates = names.pop(), self.engines.routable()
        if name is not None and candidates:
            candidates = self.adapter_candidates(name, candidates)
            if not candidates:
                for req in group:
                    self.refuse_unheld(req, name)
                return
        slots = place(self.policy, group[0].keys, candidates, self.view, self.alpha, len(group))
        if not slots:
            now = time.monotonic()
            for req in group:
                req.queued_at = now
                self.requests.unrouted[req.rid] = req
            return
        previous = None
        for req, slot in zip(group, slots):
            self._send(req, slot, assign=slot is not previous)
            previous = slot

    def _send(self, req: OpenRequest, slot: EngineSlot, assign: bool = True) -> None:
        slot.pending += 1
        slot.submitted += 1
        req.engine = slot
        req.placements += 1
        self.counts["routed"] += 1
        if assign and slot.affinity and req.keys:
            self.view.assign(slot.index, req.keys, slot.submitted)
        reply = None if req.stream else self.replies.get(req.client)
        self.outbox.to_engine(slot, self.handoffs.route_kind(slot), req.rid, slot.submitted, req.prompt, req.sampling, req.stream, req.digests,
                              None if reply is None else (reply, req.client_rid))

    def abort(self, client: Any, client_rid: int) -> None:
        req = self.requests.of_client(client, client_rid)
        if req is None:
            return
        if req.engine is None or self.handoffs.abort(req):  # waiting for an engine, or in transfer: it ends here
            self.requests.end(req.rid)
            self._tell(req, "finished", [req.partial_output("abort", None)])
        else:  # its engine ends it; its final output comes back as any other
            self.outbox.to_engine(req.engine, "abort", req.rid)

    def abort_all(self, client: Any) -> None:
        for req in self.requests.all_of_client(client):
            self.abort(client, req.client_rid)

    def client_lost(self, client: Any) -> None:
        """Its connection closed: its requests are aborted on their engines (their KV comes
        back), and nothing more is sent to it."""
        self.clients.discard(client)
        self.replies.pop(client, None)
        for req in self.requests.all_of_client(client):
            self.counts["aborted_for_client"] += 1
            self.abort(client, req.client_rid)
        self.requests.forget_client(client)
        self.controls.client_gone(client)

    def end_with_error(self, req: OpenRequest, message: str) -> None:
        """End ``req`` with "error" and its partial output."""
        self.requests.end(req.rid)
        self._tell(req, "finished", [req.partial_output("error", message)])

    def _tell(self, req: OpenRequest, kind: str, *fields: Any) -> None:
        if req.client in self.clients:
            self.outbox.to_client(req.client, kind, *fields)

    # ------------------------------------------------------------------ messages, by kind
    _ENGINE_KINDS = {"outputs": "engine_outputs", "heartbeat": "engine_heartbeat", "control_done": "engine_control_done",
                     "leave": "engine_left"}
    _CLIENT_KINDS = {k: k for k in ("submit", "abort", "abort_all", "control", "drain", "shutdown", "reply_at")} | {
        "engines": "engines_query"}

    _HANDOFF_KINDS = frozenset({"kv_ready", "kv_accepted", "kv_imported", "kv_failed", "kv_shared"})

    def engine_message(self, slot: EngineSlot, kind: str, fields: Sequence[Any]) -> None:
        """A decoded message of a registered engine (dp_engine/link.py's kinds, the hand-off's): any
        of them says it is alive."""
        if kind in self._HANDOFF_KINDS:
            slot.last_heard = time.monotonic()
            getattr(self.handoffs, kind)(slot, *fields)
            return
        if kind not in self._ENGINE_KINDS:
            raise ValueError(f"engines do not send {kind!r}")
        slot.last_heard = time.monotonic()
        getattr(self, self._ENGINE_KINDS[kind])(slot, *fields)

    def client_message(self, client: Any, kind: str, fields: Sequence[Any]) -> None:
        """A decoded message of a client (client/ kinds): submit, abort, abort_all, control, drain,
        shutdown, engines (a query answered at once)."""
        if kind not in self._CLIENT_KINDS:
            raise ValueError(f"clients do not send {kind!r}")
        getattr(self, self._CLIENT_KINDS[kind])(client, *fields)

    def reply_at(self, client: Any, endpoint: str) -> None:
        self.replies[client] = endpoint

    def engines_query(self, client: Any, op_id: int) -> None:
        self.outbox.to_client(client, "control_done", op_id, 200,
                              {"engines": self.engines.describe(), "counts": dict(self.counts), "wire": self.wire(),
                               "transfers": self.handoffs.describe()})

    # ------------------------------------------------------------------ time
    def tick(self, now: float | None = None) -> None:
        """Engines silent for longer than ``engine_timeout_s`` are dead; requests that waited too
        long for an engine end with "error"."""
        now = time.monotonic() if now is None else now
        for slot in self.engines.live():
            if now - slot.last_heard > self.engine_timeout_s:
                self.engine_timed_out(slot, now - slot.last_heard)
        self.handoffs.place_waiting()
        self.handoffs.tick(now, self.unrouted_timeout_s)
        for req in list(self.requests.unrouted.values()):
            if now - req.queued_at > self.unrouted_timeout_s:
                self.requests.end(req.rid)
                self.counts["unrouted_timeouts"] += 1
                self._tell(req, "finished", [req.partial_output(
                    "error", f"no engine took requests within {self.unrouted_timeout_s:.0f} s")])
