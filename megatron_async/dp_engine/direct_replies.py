"""An engine's connections to its clients' reply sockets (client/replies.py): the final output of a
non-streaming request goes to its client directly, one hop instead of two through the
coordinator, which is told of the end in the engine's next outputs message (``delivered``).

Trust: only where this engine reaches its coordinator through the coordinator's ipc twin, and
only to an ``ipc://`` socket in the twin's directory (this user's 0700 directory); the engine
proves the control plane's engine key and checks the client's proof (handshake.py), on a thread
of its own, so a slow or vanished client never holds the engine's loop. Until a link is up, or
once it failed or its client is gone, outputs go through the coordinator as before.

Order: the client's frame is sent before the coordinator hears of the end, on the same ZMQ
context (one I/O thread writes both in order): an engine that dies in between leaves the
request open at the coordinator, which ends it as a dead engine's (an error or a second run)
and the client drops that duplicate end (its ids are never reused). Sends never block, and a
link whose connection closed (its monitor says so) is dropped: the output takes the
coordinator's way (a connecting socket would queue it for a reconnection that never comes)."""
from __future__ import annotations

import logging
import threading

import zmq

from megatron_async.coordinator import messages
from megatron_async.coordinator.transport import PeerSocket
from megatron_async.coordinator.trust import ipc_directory
from megatron_async.inference.communication.handshake import NOBLOCK, zmq_send

log = logging.getLogger("megatron_async.dp_engine")
CONNECT_TIMEOUT_S = 5.0
MAX_LINKS = 256
"""Links kept at once (one per client): the oldest is closed past this."""
MAX_REFUSED = 4096


class DirectReplies:
    def __init__(self, coordinator_endpoint: str, secret: bytes, name: str, ctx: zmq.Context):
        """``coordinator_endpoint``: where this engine's connection to the coordinator went (direct
        replies only when it is an ipc twin: the clients' sockets are beside it)."""
        self.directory = ipc_directory(coordinator_endpoint)
        self._secret, self._name, self._ctx = secret, name, ctx
        self._links: dict[str, PeerSocket] = {}
        self._refused: set[str] = set()
        self._connecting: dict[str, threading.Thread] = {}
        self._closed = False
        self._lock = threading.Lock()
        self.sent = self.fallbacks = 0

    def usable(self, endpoint: str) -> bool:
        """A client socket this engine may answer on: in its coordinator's directory."""
        return self.directory is not None and ipc_directory(endpoint) == self.directory and ".." not in endpoint

    def prepare(self, endpoint: str) -> None:
        """A request that ``send`` will answer there arrived: the link comes up meanwhile."""
        if endpoint not in self._links:
            self._connect(endpoint)

    def send(self, endpoint: str, outputs: list) -> bool:
        """``outputs`` (ids the client's) to the client at ``endpoint``; False: not sent (no link
        yet, refused, or the client is gone): they go through the coordinator."""
        link = self._links.get(endpoint)
        if link is None:
            self._connect(endpoint)
            self.fallbacks += 1
            return False
        if link.gone():  # (a connecting socket would queue it for a peer that never comes back)
            self._drop(endpoint, refuse=True)
            self.fallbacks += 1
            return False
        try:
            zmq_send(link.sock, messages.encode("finished", outputs), NOBLOCK)
        except zmq.ZMQError:  # no connection (the client went): never again
            self._drop(endpoint, refuse=True)
            self.fallbacks += 1
            return False
        self.sent += 1
        return True

    def _connect(self, endpoint: str) -> None:
        with self._lock:
            if self._closed or endpoint in self._connecting or endpoint in self._refused or not self.usable(endpoint):
                return
            t = self._connecting[endpoint] = threading.Thread(target=self._open, args=(endpoint,), daemon=True,
                                                              name="megatron-async-reply-link")
        t.start()

    def _open(self, endpoint: str) -> None:
        try:
            link = PeerSocket(endpoint, self._secret, "engine", self._name, CONNECT_TIMEOUT_S, self._ctx)
        except Exception as e:  # noqa: BLE001 -- that client is answered through the coordinator
            log.warning("no direct replies to %s: %s", endpoint, e)
            link = None
        with self._lock:
            self._connecting.pop(endpoint, None)
            if self._closed and link is not None:  # (closed meanwhile: its context is about to end)
                link.lost = True
                link.close()
                return
            if link is None:
                self._refuse(endpoint)
                return
            links = dict(self._links)  # (the loop thread reads the dict without the lock)
            links[endpoint] = link
            self._links = links

    def sweep(self) -> None:
        """Close the links whose client is gone (its connection closed), and the oldest beyond
        ``MAX_LINKS``: from the loop, now and then (the loop is the only thread that uses a link's
        socket, so only it closes one that may be in use)."""
        for endpoint, link in list(self._links.items()):
            if link.gone():
                self._drop(endpoint, refuse=True)
        while len(self._links) > MAX_LINKS:
            with self._lock:
                links = dict(self._links)
                oldest = links.pop(next(iter(links)))
                self._links = links
            oldest.close()  # (not lost: what it still sends may linger)

    def _drop(self, endpoint: str, refuse: bool) -> None:
        with self._lock:
            links = dict(self._links)
            link = links.pop(endpoint, None)
            self._links = links
            if refuse:
                self._refuse(endpoint)
        if link is not None:
            link.lost = True  # (close at once: nothing it still holds is awaited)
            link.close()

    def _refuse(self, endpoint: str) -> None:
        if len(self._refused) >= MAX_REFUSED:  # (clients' endpoints are never reused: forgetting is harmless)
            self._refused.clear()
        self._refused.add(endpoint)

    def close(self) -> None:
        """Every link closed, those still connecting too (they end within ``CONNECT_TIMEOUT_S``):
        the ZMQ context they share with the coordinator's connection ends after this."""
        with self._lock:
            self._closed = True
            connecting = list(self._connecting.values())
        for t in connecting:
            t.join(CONNECT_TIMEOUT_S + 1)
        for endpoint in list(self._links):
            self._drop(endpoint, refuse=False)
