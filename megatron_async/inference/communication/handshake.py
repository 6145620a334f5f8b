"""Who may talk to a megatron_async socket: a mutual HMAC challenge-response on connecting, one
key per role, and per-peer liveness on the listening side.

    listener = Listener(router_sock, secret, roles={"rank": {"1", "2", "3"}}, job=job_id)
    for peer, mtype, fields in listener.take(): ...     # authenticated peers' frames only
    listener.send(peer, wire.encode(...)); listener.check_alive()   # PeerLost for a bound peer

    welcome = authenticate(dealer_sock, secret, role="rank", name="2", job=job_id)   # AuthError

Sequence (``K`` = ``derive_key(secret, role)``, ``J`` = the listener's non-secret id):
    peer     -> HELLO     [version, role, name, Np]                      (Np: 32 random bytes)
    listener -> CHALLENGE [Nl, HMAC(K, "listener"|J|role|name|Np|Nl)]    (the listener proves K first)
    peer     -> PROOF     [HMAC(K, "peer"|J|role|name|Np|Nl)]
    listener -> WELCOME   [what ``welcome(peer)`` returns]
Roles are "rank" (ranks of one job), "engine" and "client" (a coordinator's peers), "coordinator"
and "frontend" (the server's HTTP processes): a client's key cannot register an engine or
join as a rank. Fresh nonces on both sides: a recorded exchange replays nowhere. The peer checks
the listener's MAC before it sends anything else, so a peer pointed at a fake listener (a
tampered store entry) fails at once with ``AuthError``.

Peers set no ZMQ identity: the ROUTER assigns routing ids, so none can be squatted. Before a
routing id has proven the key, the listener decodes only HELLO and PROOF frames of at most
``PRE_AUTH_MAX_BYTES`` from it (peeked type; nothing else is parsed); a routing id that failed is
ignored from then on; pending handshakes are bounded in number and time. A name may be limited
to a set (ranks: "1" .. "N-1") and is then bound at most once: the first peer to prove it keeps it.

Liveness: the listener's monitor reports every accepted and closed connection by file descriptor
and each frame carries the descriptor it came on (``SRCFD``), so an authenticated peer is bound to
(fd, accepts seen on that fd). The close of a bound connection is that peer's loss (``lost()`` /
``check_alive()`` at once); the close of any other connection is a stranger leaving (counted).
This relies on libzmq reporting a connection's ACCEPTED before its first frame (it does: both
come from the one I/O thread, ACCEPTED at accept time)."""
from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Collection

import zmq
from zmq.utils.monitor import recv_monitor_message

from megatron_async.inference.communication import wire

VERSION = 1
ROLES = ("rank", "engine", "coordinator", "client", "frontend")
PRE_AUTH_MAX_BYTES = 512
MAX_NAME_LEN = 128
MAX_PENDING = 256
HANDSHAKE_TIMEOUT_S = 10.0
_REFUSED_MEMORY = 4096

POLLIN, SNDMORE, NOBLOCK = int(zmq.POLLIN), int(zmq.SNDMORE), int(zmq.NOBLOCK)
"""pyzmq's flags as plain ints for the send and receive paths: an ``|`` of its enums builds an
enum member in Python. Whether a socket has a message waiting is asked with ``zmq_poll(items, 0)``
(``items = readable(sock)``), not ``getsockopt(EVENTS)``: pyzmq's getsockopt looks its option up
as a ``SocketOption`` enum member in Python on every call (~0.6 us, several per message), and a
message's further parts are told by the received frame's ``more``, not by ``RCVMORE``."""
zmq_poll = zmq.zmq_poll
zmq_send = zmq.backend.Socket.send
"""``zmq_send(sock, frame, flags)``: the Cython send under pyzmq's ``Socket.send``, a Python
override (for draft sockets' routing_id and group, unused here) whose frames and keyword call
cost every send."""


def readable(sock: zmq.Socket) -> list:
    """``zmq_poll(readable(sock), 0)`` is true while ``sock`` has a message (or a part) waiting."""
    return [(sock, POLLIN)]


HELLO = wire.message_type("hello", 1, arity=4)
CHALLENGE = wire.message_type("challenge", 2, arity=2)
PROOF = wire.message_type("proof", 3, arity=1)
WELCOME = wire.message_type("welcome", 4, arity=1)
PRE_AUTH = frozenset({HELLO, PROOF})
"""What a listener decodes from a routing id that has not proven the key."""


class AuthError(RuntimeError):
    """This process was refused, or the listener it reached does not hold its key."""


class PeerLost(RuntimeError):
    """An authenticated peer's connection closed (its process exited or died)."""


def derive_key(secret: bytes, role: str) -> bytes:
    """The role's key from the secret: one key per role."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of {ROLES})")
    return hmac.digest(secret, b"megatron_async/wire/v1\0" + role.encode(), "sha256")


def _mac(key: bytes, side: bytes, job: bytes, role: str, name: str, peer_nonce: bytes, listener_nonce: bytes) -> bytes:
    msg = b"\0".join((side, job, role.encode(), name.encode(), peer_nonce, listener_nonce))
    return hmac.digest(key, msg, "sha256")


@dataclass(eq=False)
class Peer:
    """An authenticated connection (hashable by identity)."""

    routing_id: bytes
    role: str
    name: str
    fd: int
    generation: int


@dataclass
class _Pending:
    role: str
    name: str
    peer_nonce: bytes
    listener_nonce: bytes
    since: float


class Listener:
    def __init__(self, sock: zmq.Socket, secret: bytes | None, roles: dict[str, Collection[str] | None], job: bytes = b"",
                 max_frame_bytes: int = 64 << 20, welcome: Callable[[Peer], Any] | None = None,
                 stats: wire.WireStats | None = None):
        """The authenticating side of ROUTER ``sock`` (made before it binds, so that the monitor
        sees every connection). ``roles``: role -> the names a peer of it may take (each bound at
        most once; None: any name, not unique). ``secret``: None until ``use_secret`` (no peer is
        welcome before). ``welcome(peer)``: what an authenticated peer is told (a plain value)."""
        self.sock, self.job, self.max_frame_bytes = sock, job, max_frame_bytes
        self.names = {role: None if names is None else frozenset(names) for role, names in roles.items()}
        self.keys: dict[str, bytes] = {}
        if secret is not None:
            self.use_secret(secret)
        self.stats = stats if stats is not None else wire.WireStats()
        self._welcome = welcome or (lambda peer: None)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        """Poll it with the socket: an event may be a bound peer's loss (``check_alive``)."""
        self._in, self._monitor_in = readable(sock), readable(self.monitor)
        self.peers: dict[bytes, Peer] = {}
        self.by_name: dict[tuple[str, str], Peer] = {}
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()
        self._refused: OrderedDict[bytes, None] = OrderedDict()
        self._generation: dict[int, int] = {}  # fd -> accepts seen on it
        self._lost: list[Peer] = []

    def use_secret(self, secret: bytes) -> None:
        self.keys = {role: derive_key(secret, role) for role in self.names}

    # ------------------------------------------------------------------ liveness
    def _drain_monitor(self) -> None:
        while zmq_poll(self._monitor_in, 0):
            ev = recv_monitor_message(self.monitor)
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._generation[fd] = self._generation.get(fd, 0) + 1
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                gen = self._generation.get(fd, 0)
                gone = [p for p in self.peers.values() if p.fd == fd and p.generation == gen]
                for p in gone:
                    del self.peers[p.routing_id]
                    self.by_name.pop((p.role, p.name), None)
                self._lost += gone
                if not gone:
                    self.stats.stranger_disconnects += 1

    def lost(self, drain: bool = True) -> list[Peer]:
        """Authenticated peers whose connection closed since the last call. ``drain=False``: the
        caller's poll found the monitor empty (only losses already drained, by a handshake)."""
        if drain:
            self._drain_monitor()
        out, self._lost = self._lost, []
        return out

    def check_alive(self) -> None:
        """Raises ``PeerLost`` once an authenticated peer's connection closed (sticky)."""
        self._drain_monitor()
        if self._lost:
            p = self._lost[0]
            raise PeerLost(f"{p.role} {p.name} lost its connection: its process exited or died")

    # ------------------------------------------------------------------ frames
    def take(self, waiting: bool | None = None) -> list[tuple[Peer, wire.MessageType, list]]:
        """Every frame waiting (non-blocking): handshakes are handled here, strangers' frames and
        undecodable ones dropped and counted; the authenticated peers' messages are returned
        in arrival order as (peer, type, fields). ``waiting``: what the caller's poll said of the
        socket (None: ask; False: nothing is read)."""
        out, sock, stats = [], self.sock, self.stats
        recv, poll_in = sock.recv, self._in
        known = waiting is True
        while waiting is not False and (known or zmq_poll(poll_in, 0)):  # (a poll: cheaper than a recv raising Again)
            known = False
            rid = recv()
            part = recv(copy=False)  # (a ROUTER's message: the routing id and at least one part)
            parts = [part]
            while part.more:
                part = recv(copy=False)
                parts.append(part)
            peer = self.peers.get(rid)
            if peer is None:
                stats.frames += 1
                if len(parts) == 1:
                    self._handshake(rid, parts[0])
                else:
                    stats.drop("malformed")
                continue
            for frame in parts:  # an authenticated peer may send several messages as one
                stats.frames += 1
                try:
                    mtype, fields = wire.decode(frame.buffer, self.max_frame_bytes)
                except wire.WireError as e:
                    stats.drop(e.reason)
                    continue
                out.append((peer, mtype, fields))
        if self._pending:
            self._expire()
        return out

    def send(self, peer: Peer, frame: bytes, block: bool = True) -> bool:
        """``frame`` to ``peer``; False when it is gone (its loss is reported by ``lost``)."""
        return self.send_many(peer, [frame], block)

    def send_many(self, peer: Peer, frames: list[bytes], block: bool = True) -> bool:
        """Several messages as one ZMQ message (one wake-up of the peer), in order."""
        flags, sock = 0 if block else NOBLOCK, self.sock
        try:  # (pyzmq's send_multipart: a Python loop, an enum | and a type check per part)
            zmq_send(sock, peer.routing_id, flags | SNDMORE)
            for frame in frames[:-1]:
                zmq_send(sock, frame, flags | SNDMORE)
            zmq_send(sock, frames[-1], flags)
            return True
        except zmq.ZMQError:
            self.stats.drop("undeliverable")
            return False

    def _handshake(self, rid: bytes, frame: zmq.Frame) -> None:
        if rid in self._refused:
            self.stats.drop("unauthenticated")
            return
        try:
            mtype, fields = wire.decode(frame.buffer, PRE_AUTH_MAX_BYTES, PRE_AUTH)
        except wire.WireError as e:
            self.stats.drop(e.reason)
            return
        if mtype is HELLO:
            self._hello(rid, fields)
        else:
            self._proof(rid, fields, frame)

    def _hello(self, rid: bytes, fields: list) -> None:
        version, role, name, nonce = fields
        if version != VERSION or type(role) is not str or role not in self.keys or type(name) is not str \
                or len(name) > MAX_NAME_LEN or type(nonce) is not bytes or len(nonce) != 32 or rid in self._pending:
            self.stats.drop("bad hello")
            return
        pend = self._pending[rid] = _Pending(role, name, nonce, secrets.token_bytes(32), time.monotonic())
        if len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
        mac = _mac(self.keys[role], b"listener", self.job, role, name, nonce, pend.listener_nonce)
        self._reply(rid, wire.encode(CHALLENGE, pend.listener_nonce, mac))

    def _proof(self, rid: bytes, fields: list, frame: zmq.Frame) -> None:
        pend = self._pending.pop(rid, None)
        ok = pend is not None and type(fields[0]) is bytes and hmac.compare_digest(
            fields[0], _mac(self.keys[pend.role], b"peer", self.job, pend.role, pend.name, pend.peer_nonce,
                            pend.listener_nonce))
        if ok:
            allowed = self.names[pend.role]
            # a name that is not this listener's, or is taken: the first one to prove it keeps it
            ok = allowed is None or (pend.name in allowed and (pend.role, pend.name) not in self.by_name)
        if not ok:
            self.stats.auth_failed += 1
            self._refused[rid] = None
            if len(self._refused) > _REFUSED_MEMORY:
                self._refused.popitem(last=False)
            return
        self._drain_monitor()  # this connection's ACCEPTED came before its first frame
        fd = frame.get(zmq.SRCFD)
        peer = Peer(rid, pend.role, pend.name, fd, self._generation.get(fd, 0))
        self.peers[rid] = peer
        if self.names[peer.role] is not None:
            self.by_name[(peer.role, peer.name)] = peer
        self.stats.authenticated += 1
        self._reply(rid, wire.encode(WELCOME, self._welcome(peer)))

    def _reply(self, rid: bytes, frame: bytes) -> None:
        try:
            self.sock.send_multipart([rid, frame], zmq.NOBLOCK)
        except zmq.ZMQError:  # it left already, or is not reading: nothing to do
            self.stats.drop("reply undeliverable")

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            rid, pend = next(iter(self._pending.items()))
            if now - pend.since < HANDSHAKE_TIMEOUT_S:
                break
            del self._pending[rid]
            self.stats.drop("handshake timeout")

    def close(self) -> None:
        """Stops the monitor (the caller closes its socket)."""
        if not self.monitor.closed:
            self.sock.disable_monitor()
            self.monitor.close(0)


def authenticate(sock: zmq.Socket, secret: bytes, role: str, name: str, job: bytes = b"",
                 timeout_s: float = 30.0, max_welcome_bytes: int = 1 << 20) -> Any:
    """The peer's side, on a connected DEALER (no identity set): returns what the listener's
    ``welcome`` said; ``AuthError`` if the listener cannot prove the key or does not welcome
    this peer within ``timeout_s`` (wrong secret, a name not allowed or taken, nobody there)."""
    key = derive_key(secret, role)
    mine = secrets.token_bytes(32)
    sock.send(wire.encode(HELLO, VERSION, role, name, mine))
    theirs, mac = _expect(sock, CHALLENGE, timeout_s, PRE_AUTH_MAX_BYTES)
    if type(theirs) is not bytes or type(mac) is not bytes or not hmac.compare_digest(
            mac, _mac(key, b"listener", job, role, name, mine, theirs)):
        raise AuthError(f"the listener does not hold this {role}'s key ({role} {name}): a wrong secret, or the "
                        "address this process was given is not the one meant")
    sock.send(wire.encode(PROOF, _mac(key, b"peer", job, role, name, mine, theirs)))
    return _expect(sock, WELCOME, timeout_s, max_welcome_bytes)[0]


def _expect(sock: zmq.Socket, want: wire.MessageType, timeout_s: float, max_bytes: int) -> list:
    if not sock.poll(int(timeout_s * 1000)):
        raise AuthError(f"no {want.name} within {timeout_s:.0f} s: the listener refused this peer (a wrong secret, a "
                        "name not allowed or already taken) or nothing listens there")
    try:
        return wire.decode(sock.recv(), max_bytes, frozenset({want}))[1]
    except wire.WireError as e:
        raise AuthError(f"unexpected answer to the handshake ({e})") from None
