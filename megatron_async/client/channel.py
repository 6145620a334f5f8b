"""The client's connection to the coordinator on an asyncio event loop: authenticated once
(off the loop: the handshake blocks), then read from the loop itself (``add_reader`` on the
socket's descriptor: no thread of its own). ZMQ's descriptor signals edges, so every wake-up
reads everything waiting, and a send that took the readable edge schedules a read.

Sending: the first message of a turn of the event loop leaves at once (one request at a time
waits for no turn of the loop); what follows it in the same turn is queued and leaves as one
message when the turn ends (a loaded client's many requests: one wake-up of the coordinator).

Reached through the coordinator's ipc twin (same host), the client also listens on a reply
socket (replies.py) where engines send the final outputs of its non-streaming requests."""
from __future__ import annotations

import asyncio
import os
import socket

import zmq

from megatron_async.client.replies import ReplySocket
from megatron_async.coordinator.messages import encode
from megatron_async.coordinator.transport import PeerSocket
from megatron_async.coordinator.trust import ipc_directory, peer_secret


class ClientChannel:
    def __init__(self, peer: PeerSocket, client, replies: ReplySocket | None = None):
        self.peer, self.client, self.replies = peer, client, replies
        self.loop: asyncio.AbstractEventLoop | None = None
        self._fds: list[int] = []
        self._queued: list[bytes] = []
        self._turn_open = False  # a message left in this turn of the loop: the next ones wait for its end
        client.info = peer.welcome

    @classmethod
    def connect(cls, address: str, secret, timeout_s: float, client) -> ClientChannel:
        """Authenticate now (blocking); ``attach`` to a loop before use."""
        name, key = f"{socket.gethostname()}:{os.getpid()}", peer_secret(address, secret)
        peer = PeerSocket(address, key, "client", name, timeout_s)
        replies, directory = None, ipc_directory(peer.endpoint)
        if directory is not None:  # the coordinator's twin: engines on this host answer here
            try:
                replies = ReplySocket(directory, key, peer.sock.context)
                peer.send("reply_at", replies.endpoint)
            except BaseException:
                if replies is not None:
                    replies.close(None)
                peer.close()
                raise
        return cls(peer, client, replies)

    @classmethod
    async def open(cls, address: str, secret, timeout_s: float, client) -> ClientChannel:
        loop = asyncio.get_running_loop()
        channel = await loop.run_in_executor(None, cls.connect, address, secret, timeout_s, client)
        channel.attach(loop)
        return channel

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        for sock in (self.peer.sock, self.peer.monitor):
            fd = sock.getsockopt(zmq.FD)
            loop.add_reader(fd, self._read)
            self._fds.append(fd)
        loop.call_soon(self._read)  # what arrived before
        if self.replies is not None:
            self.replies.attach(loop, self.client.receive)

    def send(self, kind: str, *fields) -> None:
        """At once if it is this turn's first message, else queued until the turn ends."""
        if self.peer.lost:
            return
        if self.loop is None:
            self.peer.send(kind, *fields)
            return
        if self._turn_open:
            self._queued.append(encode(kind, *fields))
            return
        self._turn_open = True
        self.loop.call_soon(self._end_turn)
        if self._write([encode(kind, *fields)]):
            self.loop.call_soon(self._read)  # (not from inside the caller's add_request)

    def _end_turn(self) -> None:
        self._turn_open = False
        self._flush()

    def _flush(self) -> None:
        frames, self._queued = self._queued, []
        if frames and self._write(frames):
            self._read()

    def _write(self, frames: list[bytes]) -> bool:
        """``frames`` as one message; True when the send took the readable edge (read now)."""
        if self.peer.lost or self.peer.sock.closed:
            return False
        self.peer.send_frames(frames)
        return self.peer.readable()

    def _read(self) -> None:
        if self.peer.sock.closed:
            return
        for kind, fields in self.peer.take():
            self.client.receive(kind, fields)
        if self.peer.lost:
            self._detach()
            self.client.coordinator_lost(f"lost the coordinator at {self.peer.address}: it exited or died")

    def _detach(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            for fd in self._fds:
                self.loop.remove_reader(fd)
        self._fds = []

    def close(self) -> None:
        self._flush()
        self._detach()
        if self.replies is not None:  # (before the context it shares ends with the coordinator's connection)
            self.replies.close(self.loop)
        self.peer.close()
