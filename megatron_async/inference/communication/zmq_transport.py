"""How the communicator's frames move among ranks: the sockets, how ranks find and authenticate
each other, and whether the peers are still there. It never looks inside a message beyond its
type (wire.py frames; the collectives read them).

Rank 0 binds a ROUTER where the rendezvous decided (rendezvous.py: ``ipc://`` in a private
directory only when every rank is on its host, else also TCP on the interface towards
MASTER_ADDR) and publishes the endpoints in the torch.distributed store. Every other rank
connects a DEALER (no ZMQ identity: nothing to squat) and proves the job's key (handshake.py)
before anything else. Rank 0 reads its socket only through the ``Listener``: a stranger's
connection, frames or disconnection never reach the collectives (they are dropped and counted
in ``stats``), and only the close of an authenticated rank's connection is a rank's death.

Every wait has a deadline, so a silent peer raises instead of hanging; a dead rank makes the
waiting ranks raise at once."""
from __future__ import annotations

import shutil
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from megatron_async.inference.communication import wire
from megatron_async.inference.communication.handshake import AuthError, Listener, PeerLost, authenticate
from megatron_async.inference.communication.rendezvous import plan

MAX_FRAME_BYTES = 64 << 20
"""Largest frame between ranks (rank 0's payload or an upload too big for shared memory): libzmq
closes the connection of a larger message before buffering it."""


class CommunicatorError(RuntimeError):
    """A peer timed out, died, or answered a different collective (the ranks have diverged)."""


class LeaderEnded(Exception):
    """Rank 0 announced the end of the job (``status``: its exit status) while this rank waited for
    it: an orderly end, not a failure of the link (a rank that dies unannounced raises
    ``CommunicatorError``)."""

    def __init__(self, rank: int, status: int, what: str):
        super().__init__(f"rank {rank}: rank 0 ended the job (exit status {status}) in {what}")
        self.rank, self.status = rank, status


class ZMQTransport:
    def __init__(self, rank: int, world_size: int, store, key: str, timeout_ms: int | None, join_timeout_s: float,
                 force_tcp: bool = False):
        """Collective over ``store``: rank 0 binds and publishes under ``key``; the others connect
        and authenticate (``join_timeout_s`` at most). ``timeout_ms``: the longest wait for one
        message (None: forever). ``force_tcp``: as if the ranks spanned hosts (tests, measurements)."""
        self.rank, self.world_size = rank, world_size
        self.timeout_ms = timeout_ms
        """The longest wait in ms (None: forever); a caller may widen it while joining."""
        self.waited_ns = 0
        """Nanoseconds spent waiting for messages since the caller last reset it."""
        self.plan = plan(store, rank, world_size, key, force_tcp)
        self.stats = wire.WireStats()
        """Rank 0: what strangers sent and did (frames dropped by reason, refused handshakes, closes)."""
        self.endpoints: list[str] = []
        self.linger_ms = 0
        """How long ``close`` lets queued frames leave (0: dropped)."""
        self.listener: Listener | None = None
        self._lost: str | None = None
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER if rank == 0 else zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        try:
            if rank == 0:
                self._bind(store, key)
                self._monitor = self.listener.monitor
            else:
                self._connect(store, key, join_timeout_s)
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _bind(self, store, key: str) -> None:
        for ep in self.plan.bind:
            if ep.startswith("tcp://") and ep.endswith(":0"):
                host = ep[:-2]
                ep = f"{host}:{self.sock.bind_to_random_port(host)}"
            else:
                self.sock.bind(ep)
            self.endpoints.append(ep)
        names = {str(r) for r in range(1, self.world_size)}
        self.listener = Listener(self.sock, self.plan.secret, {"rank": names}, self.plan.job, MAX_FRAME_BYTES,
                                 stats=self.stats)
        store.set(f"{key}/endpoints", " ".join(self.endpoints))

    def _connect(self, store, key: str, timeout_s: float) -> None:
        published = store.get(f"{key}/endpoints").decode().split(" ")
        ipc = [e for e in published if e.startswith("ipc://")]
        tcp = [e for e in published if e.startswith("tcp://")]
        if not (ipc and self.plan.directory is not None) and not tcp:
            raise CommunicatorError(f"rank {self.rank}: rank 0 listens on {published} only, which this host cannot reach")
        self.endpoints = [ipc[0] if ipc and self.plan.directory is not None else tcp[0]]
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(self.endpoints[0])
        try:
            authenticate(self.sock, self.plan.secret, "rank", str(self.rank), self.plan.job, timeout_s)
        except AuthError as e:
            raise CommunicatorError(f"rank {self.rank} could not join rank 0 at {self.endpoints[0]}: {e}") from None

    # ------------------------------------------------------------------ moving frames
    def send_to_root(self, frame: bytes) -> None:
        self.sock.send(frame)

    def send_to(self, peer: int, frame: bytes) -> None:
        """Rank 0: ``frame`` to rank ``peer``."""
        p = self.listener.by_name.get(("rank", str(peer)))
        if p is None or not self.listener.send(p, frame):
            self.alive()
            raise CommunicatorError(f"rank 0: rank {peer} is not connected")

    def send_to_peers(self, frame: bytes) -> None:
        """Rank 0: ``frame`` to every other rank."""
        for peer in range(1, self.world_size):
            self.send_to(peer, frame)

    def recv_from_root(self, what: str) -> tuple[wire.MessageType, list]:
        """The next message from rank 0, decoded (a frame rank 0 sent that does not decode is
        this job's bug: it raises)."""
        self._wait(what, time.monotonic())
        try:
            return wire.decode(self.sock.recv(copy=False).buffer, MAX_FRAME_BYTES)
        except wire.WireError as e:
            raise CommunicatorError(f"rank {self.rank}: rank 0 sent a frame that does not decode ({e}) in {what}") from None

    def recv_from_peers(self, what: str) -> list[tuple[int, wire.MessageType, list]]:
        """Rank 0: (rank, type, fields) of the ranks' messages waiting, at least one; strangers'
        frames are handled (dropped, counted) on the way."""
        t0 = time.monotonic()
        while True:
            self._wait(what, t0)
            got = self.take_waiting()
            if got:
                return got

    def take_waiting(self) -> list[tuple[int, wire.MessageType, list]]:
        """Rank 0: (rank, type, fields) of the ranks' messages waiting now (non-blocking); strangers'
        frames are dropped and counted on the way (the shared-memory path calls it every round,
        so they never pile up unread)."""
        return [(int(peer.name), mtype, fields) for peer, mtype, fields in self.listener.take()]

    # ------------------------------------------------------------------ liveness
    def _wait(self, what: str, since: float) -> None:
        """Until a frame can be read; raises CommunicatorError ``timeout_ms`` after ``since`` or
        when a rank's connection closes (``what``: the collective waited in)."""
        while True:
            left = None if self.timeout_ms is None else max(0, int(self.timeout_ms - 1000 * (time.monotonic() - since)))
            t0 = time.perf_counter_ns()
            ready = dict(self._poller.poll(left))
            self.waited_ns += time.perf_counter_ns() - t0
            if self.sock in ready:  # a message sent before its sender died is still delivered
                return
            if self._monitor in ready:
                if self.listener is None and self.sock.poll(0):  # rank 0's last frames come before its close
                    return
                self.alive(what)  # raises for a rank; a stranger's close is only counted
                continue
            if left == 0 or not ready:
                raise CommunicatorError(f"rank {self.rank}: no message within {self.timeout_ms} ms in {what}")

    def alive(self, what: str = "shared memory") -> None:
        """Raises if a rank's connection closed (rank 0 hears of every rank, the others of rank
        0). Sticky: a peer that published its last round and exited is reported at the next wait."""
        if self.listener is not None:
            try:
                self.listener.check_alive()
            except PeerLost as e:
                raise CommunicatorError(f"rank 0: lost the connection to a peer in {what} ({e})") from None
            return
        if self._lost is None and self._monitor.poll(0):
            self._lost = recv_monitor_message(self._monitor)["endpoint"].decode()
        if self._lost is not None:
            raise CommunicatorError(f"rank {self.rank}: lost the connection to rank 0 ({self._lost}) in {what}: "
                                    "a rank exited or died")

    def close(self) -> None:
        """Frames still queued may take ``linger_ms`` to leave (rank 0's announcement of the end)."""
        if self.listener is not None:
            self.listener.close()
        elif getattr(self, "_monitor", None) is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
        self.sock.close(linger=self.linger_ms)
        self._ctx.term()
        if self.rank == 0 and self.plan.directory is not None:
            shutil.rmtree(self.plan.directory, ignore_errors=True)  # the socket file, token and secret
