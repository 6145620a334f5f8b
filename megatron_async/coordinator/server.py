"""The coordinator's event loop: one listening socket (transport.py) for engines and clients,
the core (core.py) behind it. Each message is checked for its sender's role and its fields'
kinds before the core sees it (messages.py's readers); a bad one is dropped and counted
(``listener.stats``), never an error of the loop. A peer whose connection closed is an engine lost (its requests routed again
or ended) or a client gone (its requests aborted). An engine silent for ``engine_timeout_s``
with its connection open (hung) is lost the same way; whatever it sends afterwards is dropped
and counted ("dead engine"): it must join again, from a new connection.

Placement: its own process (``python -m megatron_async.coordinator``, or spawned by
``LLM(..., listen=...)``), so that it survives engines that die and competes with no engine for
a GIL; ``serve(stop)`` also runs it on a thread (tests)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from megatron_async.coordinator.core import ENGINE_TIMEOUT_S, UNROUTED_TIMEOUT_S, CoordinatorCore
from megatron_async.coordinator.engines import EngineInfo, EngineSlot, EngineState, RegistrationError
from megatron_async.coordinator.messages import encode
from megatron_async.coordinator.transport import ControlListener, Peer
from megatron_async.coordinator.trust import ipc_twin, listener_secret, remove_secret_file
from megatron_async.inference.communication.handshake import readable, zmq_poll

log = logging.getLogger("megatron_async.coordinator")
TICK_S = 1.0
STOP_POLL_S = 0.1  # with a stop event (a signal's, a thread's), how long a poll may keep it waiting


class CoordinatorServer:
    def __init__(self, address: str, policy: str = "load_balanced", alpha: float = 0.5, secret: bytes | str | None = None,
                 unrouted_timeout_s: float = UNROUTED_TIMEOUT_S, seed: int = 0, ctx: zmq.Context | None = None,
                 engine_timeout_s: float = ENGINE_TIMEOUT_S):
        """Bind ``address`` (loopback or ipc unless a secret is configured: trust.py).
        ``engine_timeout_s``: an engine that sent nothing for this long is dead."""
        self.core = CoordinatorCore(self, policy, alpha, unrouted_timeout_s, seed, engine_timeout_s)
        self.listener = ControlListener(address, self._welcome, ctx)
        self.address = self.listener.bound
        try:
            self.listener.use_secret(listener_secret(self.address, secret))
        except BaseException:
            self.listener.close()
            raise
        self._bind_twin()
        self._slots: dict[Peer, EngineSlot] = {}
        self.core.wire = self.wire_counts

    def _bind_twin(self) -> None:
        """Loopback TCP: the same socket on its ipc twin too (trust.py), where local peers connect."""
        twin = ipc_twin(self.address)
        if twin is None:
            return
        try:
            twin.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.listener.sock.bind(f"ipc://{twin}")
        except (OSError, zmq.ZMQError) as e:  # TCP serves them all, a little slower
            log.warning("no ipc twin at %s (%s): local peers connect over TCP", twin, e)

    def wire_counts(self) -> dict:
        """The listener's counters (client.engines()["wire"]): frames dropped by reason, handshakes."""
        st = self.listener.stats
        return {"frames": st.frames, "dropped": dict(st.dropped), "authenticated": st.authenticated,
                "auth_failed": st.auth_failed, "stranger_disconnects": st.stranger_disconnects}

    def _welcome(self, peer: Peer) -> dict:
        if peer.role == "client":
            self.core.clients.add(peer)
            return self.core.info()
        return {}

    # ---------------------------------------------------------------- the core's outbox
    def to_engine(self, slot: EngineSlot, kind: str, *fields: Any) -> None:
        self.listener.send(slot.peer, encode(kind, *fields))

    def to_client(self, client: Peer, kind: str, *fields: Any) -> None:
        self.listener.send(client, encode(kind, *fields))

    # ---------------------------------------------------------------- the loop
    def serve(self, stop: threading.Event | None = None) -> None:
        """Until a client's shutdown completed (or ``stop`` is set)."""
        sock, listener = self.listener.sock, self.listener
        items, next_tick = readable(sock) + readable(listener.monitor), 0.0
        wait_ms = int((TICK_S if stop is None else STOP_POLL_S) * 1000)
        while not self.core.done and (stop is None or not stop.is_set()):
            waiting = events = False  # (what the poll found is not asked again)
            for which, _ in zmq_poll(items, wait_ms):
                if which is sock:
                    waiting = True
                else:
                    events = True
            for peer, kind, fields in listener.take(waiting):
                self._dispatch(peer, kind, fields)
            listener.flush()  # what the messages caused leaves first: the rest waits for nobody
            for peer in listener.lost(events):  # after the frames it sent before closing
                self._lost(peer)
            now = time.monotonic()
            if now >= next_tick:  # timeouts are whole seconds: not looked for at every message
                self.core.tick(now)
                next_tick = now + TICK_S / 4
            listener.flush()

    def _dispatch(self, peer: Peer, kind: str, fields: list) -> None:
        try:
            if peer.role == "engine":
                self._from_engine(peer, kind, fields)
            else:
                self.core.client_message(peer, kind, fields)
        except Exception:  # noqa: BLE001 -- one message must not end the coordinator
            log.exception("a %s message from %s %s failed", kind, peer.role, peer.name)
            self.listener.stats.drop("failed")

    def _from_engine(self, peer: Peer, kind: str, fields: list) -> None:
        slot = self._slots.get(peer)
        if slot is not None and slot.state is EngineState.GONE:  # declared dead while connected
            self.listener.stats.drop("dead engine")
        elif kind == "register" and slot is None:
            info: EngineInfo = fields[0]
            try:
                self._slots[peer] = slot = self.core.engine_registered(peer, info)
            except RegistrationError as e:
                self.listener.send(peer, encode("rejected", -1, str(e)))
                self.listener.flush()
                return
            self.listener.send(peer, encode("info", {"index": slot.index, **self.core.info()}))
        elif slot is None or kind == "register":
            self.listener.stats.drop("unregistered")
        else:
            self.core.engine_message(slot, kind, fields)
            if kind == "leave":
                self._slots.pop(peer, None)

    def _lost(self, peer: Peer) -> None:
        if peer.role == "engine":
            slot = self._slots.pop(peer, None)
            if slot is not None:
                self.core.engine_lost(slot)
        else:
            self.core.client_lost(peer)

    def close(self) -> None:
        self.listener.close()
        remove_secret_file(self.address)
