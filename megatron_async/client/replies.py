"""A client's reply socket: where its engines send the final outputs of its non-streaming
requests themselves (dp_engine/direct_replies.py), one hop instead of two through the coordinator.

Made only when the client reached its coordinator through the coordinator's ipc twin: a Unix
socket in the same 0700 directory, whose endpoint the client tells the coordinator
(``reply_at``), which passes it to engines with each route. It is a listener of the one
handshake (handshake.py): an engine proves the control plane's engine key after the client
proved it first; a stranger's frames, and anything an engine sends but ``finished``, are
dropped and counted (``stats``). Read from the client's event loop like its channel; an
engine's output under a request id already ended (a dead engine's request ended again by the
coordinator) is dropped by the client (``InferenceClient._end``)."""
from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import zmq

from megatron_async.coordinator import messages
from megatron_async.coordinator.transport import ControlListener


class ReplySocket:
    def __init__(self, directory: str, secret: bytes, ctx: zmq.Context):
        path = Path(directory) / f"client-{os.getpid()}-{secrets.token_hex(6)}.ipc"
        self.listener = ControlListener(f"ipc://{path}", lambda peer: {}, ctx, {"engine": messages.ENGINE_REPLIES})
        self.listener.use_secret(secret)
        self.endpoint, self._path = self.listener.bound, path
        self.stats = self.listener.stats
        self.received = 0
        """Final outputs that came this way."""
        self._fds: list[int] = []

    def attach(self, loop: asyncio.AbstractEventLoop, receive) -> None:
        """Read on ``loop``: ``receive(kind, fields)`` for each engine's message."""
        self._receive = receive
        for sock in (self.listener.sock, self.listener.monitor):
            fd = sock.getsockopt(zmq.FD)
            loop.add_reader(fd, self.read)
            self._fds.append(fd)
        loop.call_soon(self.read)

    def read(self) -> None:
        if self.listener.sock.closed:
            return
        for _, kind, fields in self.listener.take():
            self.received += len(fields[0])
            self._receive(kind, fields)
        self.listener.lost()  # (an engine that left: nothing to do)

    def close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        if loop is not None and not loop.is_closed():
            for fd in self._fds:
                loop.remove_reader(fd)
        self._fds = []
        self.listener.close()
        try:
            self._path.unlink()
        except FileNotFoundError:
            pass
