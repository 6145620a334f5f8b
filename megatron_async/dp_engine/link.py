"""An engine serving a data-parallel coordinator: one thread owns the engine and its channel to
the coordinator, takes what arrived (submissions, aborts, control operations, drain) at each
step boundary, steps, and sends that step's updates and final outputs in one message, with the
keys of the prefix-cache blocks the step reclaimed, the engine's load, and its cache's key when
new weights changed it.

Ids: the coordinator's request ids travel on the channel; the engine numbers its requests itself
(its ids only grow, and a request the coordinator re-routes after another engine died keeps its
id). Control operations (``coordinator/controls.py``) run here between two steps (one that waits
for another process, a ``Deferred``, answers at the turn its wait ended); "stop" aborts
every request, and once they ended the engine leaves, as after "drain" (without aborting). If the
coordinator goes away, or says this engine was declared dead (``rejected`` -1: it was silent for
its timeout), every request is aborted and the loop ends: nobody is left to read them.

Liveness: the coordinator declares an engine that sent nothing for ``--engine-timeout-s`` dead.
Between steps the loop sends a ``heartbeat`` when it sent nothing for ``HEARTBEAT_S``; while it
is inside a step or a control operation (a long prefill, a weight update) a thread of its own
sends them, for at most ``step_watchdog_s`` of one step: a loop thread stuck longer than that
stops vouching for the engine, and the coordinator moves its requests.

Messages in (``channel.poll``; coordinator/messages.py): ``route`` (rid, submission number, prompt,
sampling map, stream, the prompt's block digests: the engine reads them instead of hashing it),
``abort`` (rid), ``control`` (op id, op, args), ``drain`` (); a prefill or decode engine's
hand-off messages (``prefill``, ``kv_*``) go to its ``handoffs`` (disaggregation/engine_side.py). Out (``channel.send``):
``outputs`` (last submission number received, [RequestUpdate], [RequestOutput], rejected
[(rid, message)], failed [(rid, message)], evicted keys, load, free KV blocks, new cache key |
None), ``heartbeat`` (load, free KV blocks), ``control_done`` (op id, status, body), ``leave`` ()."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

from megatron_async.coordinator.engines import EngineInfo
from megatron_async.inference.dp_routing import keys_of
from megatron_async.inference.communication.wire import WireError
from megatron_async.inference.records import decode_sampling
from megatron_async.inference.request import InvalidRequestError
from megatron_async.dp_engine.engine_ops import Deferred
from megatron_async.dp_engine.link_controls import DEFERRED_POLL_S, LinkControls, held_adapters
from megatron_async.dp_engine.liveness import HEARTBEAT_S, Liveness

log = logging.getLogger("megatron_async.dp_engine")
STEP_WATCHDOG_S = 600.0
"""Longest step (or control operation) during which the heartbeat thread still vouches for the engine."""
DELIVERED_FLUSH_S = 0.005
"""The ends of requests answered directly (direct_replies.py) ride the next outputs message, or
leave on their own this long after the first: the coordinator's wake-up for them stays off the
requests' path (a core it would take from their clients on a small host)."""
HANDOFF_POLL_S = 0.002
"""How long an idle engine sleeps between looks at its KV transfers in flight."""
MAX_FAILED_STEPS = 3
"""Consecutive failed steps after which the link stops stepping for the requests it failed."""


class EngineChannel(Protocol):
    lost: bool
    """The coordinator's connection closed."""

    def poll(self, timeout_s: float) -> list[tuple[str, tuple]]: ...
    def send(self, kind: str, *fields: Any) -> None: ...


class EngineLink(LinkControls):
    def __init__(self, engine, channel: EngineChannel, max_requests: int, name: str = "engine",
                 update_weights: Callable | None = None, communicator=None, step_watchdog_s: float = STEP_WATCHDOG_S,
                 role: str = "mixed", kv_transfer_backend: str = "auto", address: str = "",
                 kv_transfer_kernel: bool = False, kv_send_mid_step: bool = False):
        """``update_weights``: the LLM's (control op "update_weights" with a checkpoint ``path``);
        ``communicator``: tensor parallelism: this link runs on rank 0 and tells the other ranks
        (``follow_rank0``) to step, and to run the operations every rank runs. ``step_watchdog_s``:
        heartbeats stop once one step or operation has run this long (the engine is hung).
        ``role``: "mixed", or "prefill" / "decode" with the hand-off's ``kv_transfer_backend``
        (disaggregation/engine_side.py; ``address``: the coordinator's; ``kv_transfer_kernel``: chunks
        moved by one Triton launch a side; ``kv_send_mid_step``: a prefill engine starts kv_sends
        while its step runs, disaggregation/mid_step.py)."""
        self.engine, self.channel = engine, channel
        self.max_requests, self.name = max_requests, name
        self._update_weights, self._comm = update_weights, communicator
        alloc = engine.context.allocator
        self._alloc = alloc
        self._evicted = alloc.record_evictions() if alloc.enable_prefix_caching else None
        """Digests of the cached blocks the engine reclaimed, reported with the next outputs."""
        self._key = alloc.hash_key
        self._rid_of: dict[int, int] = {}  # engine id -> coordinator rid, until its final output
        self._engine_id: dict[int, int] = {}  # coordinator rid -> engine id
        self._orphans: set[int] = set()  # engine ids failed here, stepped until the engine ends them
        self._quiet: set[int] = set()  # engine ids of requests nobody streams: no update in the step that ends them
        self._replies = getattr(channel, "replies", None)  # direct_replies.py (None: all via the coordinator)
        self._reply_of: dict[int, tuple[str, int]] = {}  # engine id -> (its client's endpoint, the client's id)
        self._next_sweep = 0.0
        self._delivered: list[int] = []  # rids answered directly, not yet told to the coordinator
        self._delivered_at = 0.0
        self._seen_seq = 0
        self._rejected: list[tuple[int, str]] = []
        self._failed: list[tuple[int, str]] = []
        self._failed_steps = 0
        self._leaving: str | None = None  # "drain" | "stop"
        self._stop_reply: tuple[int, tuple[int, Any]] | None = None
        self._deferred: list[tuple[int, str, Deferred]] = []  # (op id, op, operation) waiting off this thread
        self._paused_idle = False
        self.liveness = Liveness(channel, step_watchdog_s, (0, alloc.num_available))  # (liveness.py)
        self._declared_dead: str | None = None
        self._thread: threading.Thread | None = None
        self.ended: str | None = None
        """Why ``run`` returned: "left" (drained or stopped), "coordinator lost" or "declared dead"."""
        self.role = role
        self.handoffs = None
        if role != "mixed":
            if communicator is not None:
                raise ValueError(f"role={role!r} needs an engine of one rank (no tensor parallelism)")
            from megatron_async.disaggregation.engine_side import EngineHandOffs

            self.handoffs = EngineHandOffs(self, role, kv_transfer_backend, address, kv_transfer_kernel)
            if role == "prefill" and kv_send_mid_step:  # (kv_sends started while its step runs on the device)
                from megatron_async.disaggregation.mid_step import MidStepSends

                self.handoffs.mid_step = MidStepSends(channel, self.liveness.lock, self.handoffs)
                engine.context.device.while_waiting = self.handoffs.mid_step.wait

    def info(self) -> EngineInfo:
        alloc = self._alloc
        h = self.handoffs
        return EngineInfo(self.name, self.max_requests, alloc.capacity, self.engine.context.block_size, alloc.hash_key,
                          alloc.enable_prefix_caching, self.role, h.kv_address if h else "", h.backend if h else "gloo",
                          tuple(held_adapters(self.engine)))

    # ---------------------------------------------------------------- messages in
    def handle(self, kind: str, fields: tuple) -> None:
        self._paused_idle = False
        if kind == "route":
            self.submit(*fields)
        elif kind == "prefill" and self.handoffs is not None:
            self.handoffs.prefill(fields)
        elif self.handoffs is not None and kind in self.handoffs.INBOUND:
            self.handoffs.handle(kind, fields)
        elif kind == "abort":
            local = self._engine_id.get(fields[0])
            if local is None and self.handoffs is not None:  # (a prefill still waiting for room: admitted to end)
                local = self.handoffs.admit_waiting(fields[0])
            if local is not None:
                self.engine.abort_request(local)
        elif kind == "control":
            self._control(*fields)
        elif kind == "drain":
            self._leaving = self._leaving or "drain"
        elif kind == "rejected":
            self._declared_dead = fields[1]

    def submit(self, rid: int, seq: int, prompt, params, stream: bool, digests: bytes = b"",
               reply: tuple[str, int] | None = None) -> int | None:
        self._seen_seq = max(self._seen_seq, seq)
        if self._leaving == "stop":
            self._rejected.append((rid, "the engine is stopping"))
            return
        try:
            if isinstance(params, dict):  # as it travels (records.encode_sampling's map): checked, built
                params = decode_sampling(params, frozen=False)  # without 30 __setattr__ calls (admission copies it)
        except (WireError, TypeError, ValueError) as e:
            self._rejected.append((rid, f"bad sampling parameters: {e}"))
            return
        try:
            local = self.engine.add_request(prompt, params, prompt_digests=digests)
        except InvalidRequestError as e:
            self._rejected.append((rid, str(e)))
            return
        except Exception as e:  # noqa: BLE001 -- refused alone; the engine keeps serving the others
            log.exception("add_request failed unexpectedly")
            self._rejected.append((rid, f"the engine could not admit this request: {type(e).__name__}: {e}"))
            return
        self.track(rid, seq, local, stream, reply)
        return local

    def track(self, rid: int, seq: int, local: int, stream: bool, reply: tuple[str, int] | None) -> None:
        """Engine request ``local`` serves the coordinator's ``rid`` (its outputs go there, or to its client)."""
        self._seen_seq = max(self._seen_seq, seq)
        self._rid_of[local], self._engine_id[rid] = rid, local
        if not stream:
            self._quiet.add(local)
            if reply is not None and self._replies is not None:
                self._reply_of[local] = reply
                self._replies.prepare(reply[0])

    def detach(self, local: int) -> int | None:
        """Forget engine request ``local`` (it continues on another engine); its rid."""
        rid = self._rid_of.pop(local, None)
        if rid is not None:
            del self._engine_id[rid]
        self._quiet.discard(local)
        self._reply_of.pop(local, None)
        return rid

    # ---------------------------------------------------------------- the loop
    def busy(self) -> bool:
        return bool(self._rid_of or self._orphans)

    def run(self, stop: threading.Event | None = None) -> str:
        """Serve until drained / stopped ("left"), the coordinator is gone ("coordinator lost") or
        it declared this engine dead ("declared dead")."""
        done = threading.Event()
        beats = threading.Thread(target=self.liveness.run, args=(done,), name="megatron-async-heartbeat", daemon=True)
        beats.start()
        try:
            while stop is None or not stop.is_set():
                ended = self.turn()
                if ended is not None:
                    return ended
            return self._end("left")
        finally:
            done.set()
            beats.join()

    @property
    def step_watchdog_s(self) -> float:
        return self.liveness.watchdog_s

    @step_watchdog_s.setter
    def step_watchdog_s(self, seconds: float) -> None:
        self.liveness.watchdog_s = seconds

    def turn(self, wait: bool = True) -> str | None:
        """One turn of the loop: take what arrived (waiting up to ``HEARTBEAT_S`` when idle and
        ``wait``), step if there is work, send. Returns why the loop ends, or None."""
        idle = not self.busy() or self._paused_idle
        wait_s = HEARTBEAT_S if not self._delivered else \
            max(0.0, self._delivered_at + DELIVERED_FLUSH_S - time.monotonic())  # (their ends leave on time)
        if self._deferred:  # (their end is noticed here: the wait stays short)
            wait_s = min(wait_s, DEFERRED_POLL_S)
        if self.handoffs is not None and self.handoffs.in_flight():
            wait_s = min(wait_s, HANDOFF_POLL_S)
        held = self.handoffs.mid_step.take_held() if self.handoffs is not None and self.handoffs.mid_step else []
        for kind, fields in held + self.channel.poll(wait_s if idle and wait and not held else 0.0):
            self.handle(kind, fields)  # (those held during the last step first: arrival order)
        if self._deferred:
            self._settle()
        if self.channel.lost:
            return self._end("coordinator lost")
        if self._declared_dead is not None:
            return self._end("declared dead")
        if self.busy() and not self._paused_idle:
            self._step()
        else:
            self._tell_ranks("idle")
            self._send_outputs([], [])  # rejections, evicted keys (an abort while paused)
            if self._leaving is not None and not self.busy():
                return self._end("left")
        if self.handoffs is not None:
            self.handoffs.poll()
        now = time.monotonic()
        if self._replies is not None and now >= self._next_sweep:
            self._replies.sweep()  # (links to clients that are gone)
            self._next_sweep = now + HEARTBEAT_S
        if now - self.liveness.last_sent >= HEARTBEAT_S:  # (steps without outputs: a long prompt's chunks)
            self.liveness.beat = (len(self._rid_of), self._alloc.num_available)
            self.channel.send("heartbeat", *self.liveness.beat)
            self.liveness.last_sent = time.monotonic()
        return None

    def _step(self) -> None:
        failure = None
        with self.liveness.working():
            self._tell_ranks("step")
            try:
                res = self.engine.step()
            except Exception as e:  # noqa: BLE001 -- fail the requests in flight, keep serving
                failure = e
        if failure is not None:
            log.error("engine step failed; failing %d requests", len(self._rid_of), exc_info=failure)
            self._fail_all(f"engine step failed: {type(failure).__name__}: {failure}")
            return
        self._failed_steps = 0
        if res.step_id < 0 and not res.finished and not res.updates and self.engine.is_paused:
            self._paused_idle = True  # paused with nothing to land: wait for a message
        if self.handoffs is not None:
            self.handoffs.landed(res)  # (requests that continue on a decode engine)
        updates, finished, rid_of, quiet = [], [], self._rid_of, self._quiet
        for upd in res.updates:  # the coordinator keeps them (a dead engine's partial outputs)
            rid = rid_of.get(upd.request_id)
            if rid is not None and not (upd.finished and upd.request_id in quiet):  # (its output says it all)
                updates.append(upd._replace(request_id=rid))
        direct: dict[str, list] = {}
        for out in res.finished:
            self._orphans.discard(out.request_id)
            quiet.discard(out.request_id)
            rid = rid_of.pop(out.request_id, None)
            if rid is not None:
                del self._engine_id[rid]
                reply = self._reply_of.pop(out.request_id, None) if self._reply_of else None
                if reply is None:
                    out.request_id = rid
                    finished.append(out)
                else:
                    out.request_id = reply[1]
                    direct.setdefault(reply[0], []).append((rid, out))
        if direct:
            self._reply_directly(direct, finished)
        self._send_outputs(updates, finished)

    def _reply_directly(self, direct: dict[str, list], finished: list) -> None:
        """Each client's outputs to it (direct_replies.py), before the coordinator hears of their
        end (``_delivered``); those not sent join ``finished`` under their rid."""
        for endpoint, pairs in direct.items():
            if self._replies.send(endpoint, [out for _, out in pairs]):
                if not self._delivered:
                    self._delivered_at = time.monotonic()
                self._delivered += [rid for rid, _ in pairs]
            else:
                for rid, out in pairs:
                    out.request_id = rid
                    finished.append(out)

    def _fail_all(self, message: str) -> None:
        self._failed_steps += 1
        for local, rid in list(self._rid_of.items()):
            self._failed.append((rid, message))
            self._orphans.add(local)
            try:
                self.engine.abort_request(local)
            except Exception:  # noqa: BLE001 -- best effort: the request is failed either way
                log.exception("abort of request %d failed", local)
        self._rid_of.clear()
        self._engine_id.clear()
        self._quiet.clear()
        self._reply_of.clear()
        if self._failed_steps >= MAX_FAILED_STEPS:
            self._orphans.clear()  # never spin on an engine that keeps failing
        self._send_outputs([], [])

    def _send_outputs(self, updates: list, finished: list, flush: bool = False) -> None:
        """``flush``: the directly answered ends too, however recent (``DELIVERED_FLUSH_S``)."""
        evicted = self._evicted
        key = self._alloc.hash_key
        new_key = key if key != self._key else None
        due = self._delivered and (flush or time.monotonic() - self._delivered_at >= DELIVERED_FLUSH_S)
        if not (updates or finished or due or self._rejected or self._failed or evicted or new_key is not None):
            return
        keys = keys_of(evicted) if evicted else []
        if evicted:
            evicted.clear()
        self._key = key
        rejected, failed, self._rejected, self._failed = self._rejected, self._failed, [], []
        delivered, self._delivered = self._delivered, []
        self.liveness.beat = (len(self._rid_of), self._alloc.num_available)
        self.channel.send("outputs", self._seen_seq, updates, finished, rejected, failed, keys, *self.liveness.beat, new_key,
                          delivered)
        self.liveness.last_sent = time.monotonic()

    def _end(self, why: str) -> str:
        if why != "left":  # an error where requests are lost; a coordinator that ended with none is a quiet exit
            log.log(logging.ERROR if self._rid_of else logging.INFO, "%s: aborting %d requests",
                    "the coordinator is gone" if why == "coordinator lost" else
                    f"the coordinator declared this engine dead ({self._declared_dead})", len(self._rid_of))
            for local in list(self._rid_of):
                self.engine.abort_request(local)
            for _ in range(MAX_FAILED_STEPS):  # land the aborts: their blocks come back
                if not self.engine.has_unfinished_requests():
                    break
                self._tell_ranks("step")
                self.engine.step()
        else:
            self._send_outputs([], [], flush=True)  # (its requests' ends before it leaves)
            if self._stop_reply is not None:
                self.channel.send("control_done", self._stop_reply[0], *self._stop_reply[1])
            self.channel.send("leave")
        self._tell_ranks("stop")
        if self.handoffs is not None:
            self.engine.context.device.while_waiting = None
            self.handoffs.close()
        self.ended = why
        return why

    def _tell_ranks(self, command: str) -> None:
        if self._comm is not None:
            self._comm.broadcast_object(command)

    # ---------------------------------------------------------------- on a thread
    def start(self) -> None:
        """``run`` on a daemon thread (``LLM(..., listen=...)``)."""
        self._stop_event = threading.Event()
        self._thread = threading.Thread(target=self.run, args=(self._stop_event,), name="megatron-async-engine-link",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._stop_event.set()
            self._thread.join(timeout)
