"""The coordinator's event loop: one listening socket (transport.py) for engines and clients,
the core (core.py) behind it. Each message is checked for its sender's role and its fields'
kinds before the core sees it; a bad one is dropped and counted (``Listener.counts``), never an
error of the loop. A peer whose connection closed is an engine lost (its requests routed again
or ended) or a client gone (its requests aborted).

Placement: its own process (``python -m megatron_async.coordinator``, or spawned by
``LLM(..., listen=...)``), so that it survives engines that die and competes with no engine for
a GIL; ``serve(stop)`` also runs it on a thread (tests)."""
from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from megatron_async.coordinator.core import UNROUTED_TIMEOUT_S, CoordinatorCore
from megatron_async.coordinator.engines import EngineInfo, EngineSlot, RegistrationError
from megatron_async.coordinator.messages import encode
from megatron_async.coordinator.routing import keys_from_bytes
from megatron_async.coordinator.transport import Listener, Peer
from megatron_async.coordinator.trust import listener_secret, remove_secret_file

log = logging.getLogger("megatron_async.coordinator")
TICK_S = 1.0

ENGINE_KINDS = frozenset({"register", "outputs", "heartbeat", "control_done", "leave"})
CLIENT_KINDS = frozenset({"submit", "abort", "abort_all", "control", "drain", "shutdown", "engines"})


class BadFields(ValueError):
    pass


def _int(x: Any) -> int:
    if type(x) is not int:
        raise BadFields(f"expected an int, got {type(x).__name__}")
    return x


def check_client_message(kind: str, fields: list) -> list:
    """The fields of a client's message, checked (``BadFields``): ids are ints, a prompt is text or
    a list of token ids, sampling parameters are maps (the engine checks their values)."""
    if kind == "submit":
        if len(fields) == 5:
            fields = [*fields, -1]
        first, prompt, samplings, stream, keys, epoch = fields
        _int(first), _int(epoch)
        if not isinstance(prompt, (str, list)):  # (its tokens are the engine's to check)
            raise BadFields("a prompt is text or a list of token ids")
        if not isinstance(samplings, list) or not samplings or not all(isinstance(s, dict) for s in samplings):
            raise BadFields("sampling parameters are a non-empty list of maps")
        if keys is not None:
            if type(keys) is not bytes:
                raise BadFields("routing keys are int64 bytes")
            try:
                keys = keys_from_bytes(keys)
            except ValueError as e:
                raise BadFields(str(e)) from None
        return [first, prompt, samplings, bool(stream), keys, epoch]
    if kind in ("abort", "shutdown", "engines"):
        return [_int(fields[0])]
    if kind == "control":
        if not isinstance(fields[1], str) or not isinstance(fields[2], dict):
            raise BadFields("a control operation is (id, name, map)")
        return [_int(fields[0]), fields[1], fields[2]]
    if kind == "drain":
        return [_int(fields[0]), _int(fields[1])]
    return fields


class CoordinatorServer:
    def __init__(self, address: str, policy: str = "load_balanced", alpha: float = 0.5, secret: bytes | str | None = None,
                 unrouted_timeout_s: float = UNROUTED_TIMEOUT_S, seed: int = 0, ctx: zmq.Context | None = None):
        """Bind ``address`` (loopback or ipc unless a secret is configured: trust.py)."""
        self.core = CoordinatorCore(self, policy, alpha, unrouted_timeout_s, seed)
        self.listener = Listener(address, self._welcome, ctx)
        self.address = self.listener.bound
        try:
            self.listener.use_secret(listener_secret(self.address, secret))
        except BaseException:
            self.listener.close()
            raise
        self._slots: dict[Peer, EngineSlot] = {}

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
        poller = zmq.Poller()
        poller.register(self.listener.sock, zmq.POLLIN)
        poller.register(self.listener.monitor, zmq.POLLIN)
        while not self.core.done and (stop is None or not stop.is_set()):
            poller.poll(TICK_S * 1000)
            for peer, kind, fields in self.listener.take():
                self._dispatch(peer, kind, fields)
            for peer in self.listener.lost():  # after the frames it sent before closing
                self._lost(peer)
            self.core.tick()
            self.listener.flush()

    def _dispatch(self, peer: Peer, kind: str, fields: list) -> None:
        try:
            if peer.role == "engine":
                self._from_engine(peer, kind, fields)
            elif kind in CLIENT_KINDS:
                self.core.client_message(peer, kind, check_client_message(kind, fields))
            else:
                self.listener.counts["wrong role"] += 1
        except BadFields:
            self.listener.counts["bad field"] += 1
        except Exception:  # noqa: BLE001 -- one message must not end the coordinator
            log.exception("a %s message from %s %s failed", kind, peer.role, peer.name)
            self.listener.counts["failed"] += 1

    def _from_engine(self, peer: Peer, kind: str, fields: list) -> None:
        slot = self._slots.get(peer)
        if kind == "register" and slot is None:
            info: EngineInfo = fields[0]
            try:
                self._slots[peer] = slot = self.core.engine_registered(peer, info)
            except RegistrationError as e:
                self.listener.send(peer, encode("rejected", -1, str(e)))
                self.listener.flush()
                return
            self.listener.send(peer, encode("info", {"index": slot.index, **self.core.info()}))
        elif slot is None or kind not in ENGINE_KINDS:
            self.listener.counts["wrong role"] += 1
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
