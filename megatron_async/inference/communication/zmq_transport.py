"""How the communicator's bytes move among ranks: the sockets, how ranks find each other, and
whether the peers are still there. It never looks inside a message.

Rank 0 binds a ROUTER socket; every other rank connects a DEALER named after its rank, so rank
0 knows who sent what and can address each peer. Rank 0 binds an ephemeral port on the
interface that reaches the rendezvous host and publishes the address (``publish``: through the
torch.distributed store, see ``ZMQCommunicator.from_rendezvous``), so ranks on other nodes find
it without localhost or fixed-port assumptions. It also binds a Unix-domain (``ipc://``)
endpoint: ranks on its host use that one (about half the round-trip time of TCP loopback), the
others TCP. Every wait has a timeout, so a silent peer raises instead of hanging, and a monitor
socket reports dropped connections (a peer process that died), so waiting ranks raise at once."""
from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid

import zmq
from zmq.utils.monitor import recv_monitor_message


class CommunicatorError(RuntimeError):
    """A peer timed out or answered a different collective (the ranks have diverged)."""


class ZMQTransport:
    def __init__(self, rank: int, world_size: int, host: str, port: int | None, timeout_ms: int | None,
                 publish=None, lookup=None):
        """``port`` None: rank 0 binds an ephemeral port on ``host`` and hands ``"tcp://host:port
        ipc://path hostname"`` to ``publish``; the others connect to the endpoint ``lookup()``
        returns that reaches rank 0 best. ``timeout_ms``: the longest ``wait`` (None: forever)."""
        self.rank, self.world_size = rank, world_size
        self.timeout_ms = timeout_ms
        """The longest ``wait`` in ms (None: forever); a caller may widen it while joining."""
        self.ipc_path: str | None = None
        """Rank 0, when it published its address: the Unix socket file it bound (removed at close)."""
        self._lost: str | None = None  # the endpoint of a dropped connection, once the monitor reported one
        self._ctx = zmq.Context()
        if rank == 0:
            self.sock = self._ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to an unknown peer raises
            if port is None:
                bound = self.sock.bind_to_random_port(f"tcp://{host}")
                self.ipc_path = _ipc_path()
                self.sock.bind(f"ipc://{self.ipc_path}")
                publish(f"tcp://{host}:{bound} ipc://{self.ipc_path} {socket.gethostname()}")
            else:
                self.sock.bind(f"tcp://{host}:{port}")
        else:
            self.sock = self._ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.IDENTITY, _identity(rank))
            self.sock.connect(pick_endpoint(lookup()) if port is None else f"tcp://{host}:{port}")
        self.sock.setsockopt(zmq.LINGER, 0)
        # Dropped connections (a peer process that died) are reported here, so waits end at once.
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    # ------------------------------------------------------------------ moving bytes
    def send_to_root(self, msg: bytes) -> None:
        self.sock.send(msg)

    def send_to(self, peer: int, msg: bytes) -> None:
        """Rank 0: ``msg`` to rank ``peer``."""
        self.sock.send_multipart([_identity(peer), msg])

    def send_to_peers(self, msg: bytes) -> None:
        """Rank 0: ``msg`` to every other rank."""
        for peer in range(1, self.world_size):
            self.send_to(peer, msg)

    def recv_from_root(self) -> bytes:
        """The next message from rank 0 (call ``wait`` first: this blocks)."""
        return self.sock.recv()

    def recv_from_peer(self) -> tuple[int, bytes]:
        """Rank 0: (sender's rank, message) of the next message (call ``wait`` first)."""
        identity, msg = self.sock.recv_multipart()
        return int(identity.decode().removeprefix("rank")), msg

    # ------------------------------------------------------------------ liveness
    def wait(self, what: str) -> int:
        """Until a message can be read; returns the nanoseconds waited. Raises
        CommunicatorError after ``timeout_ms`` or when a connection drops (``what``: the
        collective waited in, for the message)."""
        t0 = time.perf_counter_ns()
        ready = dict(self._poller.poll(self.timeout_ms))
        waited = time.perf_counter_ns() - t0
        if self.sock in ready:  # a message sent before its sender died is still delivered
            return waited
        if self._monitor in ready:
            event = recv_monitor_message(self._monitor)
            raise CommunicatorError(
                f"rank {self.rank}: lost the connection to a peer ({event['endpoint'].decode()}) in {what}: "
                "a rank exited or died"
            )
        raise CommunicatorError(f"rank {self.rank}: no message within {self.timeout_ms} ms in {what}")

    def alive(self) -> None:
        """Raises if the monitor reported a dropped connection (rank 0 hears of every peer, the
        others of rank 0; a rank that raises while waiting in shared memory poisons the slots for
        the rest). Sticky: a peer that published its last round and exited is reported at the
        next wait."""
        if self._lost is None and self._monitor.poll(0):
            self._lost = recv_monitor_message(self._monitor)["endpoint"].decode()
        if self._lost is not None:
            raise CommunicatorError(f"rank {self.rank}: lost the connection to a peer ({self._lost}) "
                                    "while waiting in shared memory: a rank exited or died")

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        self._ctx.term()
        if self.ipc_path is not None and os.path.exists(self.ipc_path):
            os.unlink(self.ipc_path)  # ZMQ leaves a bound socket's file behind


def _identity(rank: int) -> bytes:
    return f"rank{rank}".encode()


def _ipc_path() -> str:
    """A fresh Unix socket path (short: the limit is ~107 bytes)."""
    return os.path.join(tempfile.gettempdir(), f"ma-zmq-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def pick_endpoint(published: str) -> str:
    """Rank 0's IPC endpoint when this rank runs on its host (same host name and the socket
    file is visible here), else its TCP one."""
    tcp, ipc, host = published.split(" ")
    same_host = host == socket.gethostname() and os.path.exists(ipc.removeprefix("ipc://"))
    return ipc if same_host else tcp


def address_towards(peer_host: str) -> str:
    """This host's IP on the interface that routes to ``peer_host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(peer_host), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
