"""What the engine's process and its HTTP front-end processes say to each other (bridge.py,
frontend.py), over ZMQ ipc:// sockets in a private directory.

Front-end -> engine process (one DEALER per front-end, the bridge's ROUTER), pickled tuples:
``("ready",)``, ``("add", sid, choices, arrival)``, ``("abort", sid)``,
``("admin", sid, op, args)``, ``("query", sid, "metrics" | "health")``; the bridge answers a
query with ``("reply", sid, value)``. ``sid``: a number the front-end gives each submission,
admin call and query.

Engine thread -> front-end (a PUSH per front-end, connected to the PULL the front-end binds, so
that what is sent before the front-end is up waits in ZMQ's queue): ONE message per engine step holding every
entry of that front-end's submissions, in order, each ``(sid, kind, payload)`` as the engine
loop's outbox has it ("admitted", "rejected", "event", and "admin" outcomes). The entry of every
token of every stream, an event holding only an update, is sent flat as ``(sid, choice index,
the update's fields)``: pickling plain tuples costs a tenth of pickling NamedTuples
(``encode_entries``; python -m benchmarks ipc-encode measures a step)."""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from typing import Any

import zmq

from megatron_async.inference.request import RequestUpdate
from megatron_async.serve.engine_loop import ChoiceEvent


def encode_entries(entries: list[tuple[int, str, Any]]) -> bytes:
    """One step's ``(sid, kind, payload)`` entries for one front-end, as one message."""
    wire = []
    for sid, kind, payload in entries:
        if kind == "event" and payload.output is None and payload.error is None and payload.update is not None:
            wire.append((sid, payload.index, tuple(payload.update)))
        else:
            wire.append((sid, kind, payload))
    return pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL)


def decode_entries(message: bytes) -> list[tuple[int, str, Any]]:
    """``encode_entries``' entries back, in order."""
    out = []
    for sid, kind, payload in pickle.loads(message):
        if type(kind) is int:
            out.append((sid, "event", ChoiceEvent(kind, RequestUpdate(*payload))))
        else:
            out.append((sid, kind, payload))
    return out


def socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A socket of either side: no send or receive limit (a slow front-end buffers; the engine
    thread never blocks on it), nothing kept at close."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def encode(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


decode = pickle.loads


class Endpoints:
    """The sockets' addresses: ipc:// paths in a directory of their own (``create`` makes one,
    ``remove`` deletes it); picklable, so a front-end process is told them."""

    def __init__(self, directory: str):
        self.directory = directory

    @classmethod
    def create(cls) -> Endpoints:
        return cls(tempfile.mkdtemp(prefix="megatron-async-"))

    @property
    def bridge(self) -> str:
        return f"ipc://{os.path.join(self.directory, 'bridge')}"

    def events(self, frontend: int) -> str:
        return f"ipc://{os.path.join(self.directory, f'events-{frontend}')}"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
