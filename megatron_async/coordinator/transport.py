"""The control plane's sockets: the coordinator's ROUTER (``Listener``) and an engine's or a
client's DEALER (``PeerSocket``), with a mutual HMAC challenge-response on connecting and
per-peer liveness.

Handshake (messages.py frames; ``K`` = HMAC(secret, role): an engine's key is not a client's):
    peer     -> hello     [version, role, name, Np]                (Np: 32 random bytes)
    listener -> challenge [Nl, HMAC(K, "listener"|role|name|Np|Nl)] (the listener proves K first)
    peer     -> proof     [HMAC(K, "peer"|role|name|Np|Nl)]
    listener -> welcome   [what the peer needs: the coordinator's routing info]
Fresh nonces on both sides: a recorded exchange replays nowhere. Peers set no ZMQ identity
(ROUTER assigns one: nothing to squat). Before the proof the listener reads only hello / proof
frames of at most ``PRE_AUTH_MAX_BYTES`` from a routing id; anything else is dropped and
counted, a failed routing id is ignored from then on; pending handshakes are bounded.

Liveness: the listener's monitor reports every accepted and closed connection by file
descriptor, and each frame carries the descriptor it came in on (``SRCFD``); an authenticated
peer is bound to (fd, accepts seen on that fd), so the close of its connection is its departure
(``lost``), at once, and a stranger's close is only counted. ZMTP heartbeats (1 s, 5 s timeout)
close the connection of a peer on a host that went silent, which then reports the same way."""
from __future__ import annotations

import hmac
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from megatron_async.coordinator.messages import MAX_FRAME_BYTES, MessageError, decode, encode

VERSION = 1
ROLES = ("engine", "client")
PRE_AUTH_MAX_BYTES = 512
MAX_PENDING = 256
HANDSHAKE_TIMEOUT_S = 10.0
_PRE_AUTH = frozenset({"hello", "proof"})


class AuthError(RuntimeError):
    """This process was refused, or the coordinator it reached does not hold the secret."""


def derive_key(secret: bytes, role: str) -> bytes:
    return hmac.digest(secret, b"megatron_async/coordinator/v1\0" + role.encode(), "sha256")


def _mac(key: bytes, side: bytes, role: str, name: str, peer_nonce: bytes, listener_nonce: bytes) -> bytes:
    return hmac.digest(key, b"\0".join((side, role.encode(), name.encode(), peer_nonce, listener_nonce)), "sha256")


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.MAXMSGSIZE, MAX_FRAME_BYTES),
                       (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 5000), (zmq.HEARTBEAT_TTL, 6000)):
        sock.setsockopt(opt, value)
    return sock


@dataclass(eq=False)
class Peer:
    """An authenticated connection (hashable by identity: the coordinator keys clients by it)."""

    routing_id: bytes
    role: str
    name: str
    fd: int
    generation: int


class Listener:
    def __init__(self, address: str, welcome: Callable[[Peer], Any], ctx: zmq.Context | None = None):
        """Bind ``address`` (``tcp://HOST:0`` picks a port; ``bound`` says which); ``use_secret``
        before taking frames. ``welcome(peer)``: what a peer that proved the key is told."""
        self.ctx = ctx or zmq.Context.instance()
        self.sock = _socket(self.ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.sock.bind(address[:-2] + ":*" if address.startswith("tcp://") and address.endswith(":0") else address)
        self.bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.keys: dict[str, bytes] = {}
        self._welcome = welcome
        self.peers: dict[bytes, Peer] = {}
        self._pending: OrderedDict[bytes, tuple] = OrderedDict()
        self._refused: OrderedDict[bytes, None] = OrderedDict()
        self._generation: dict[int, int] = {}
        self._lost: list[Peer] = []
        self._out: dict[Peer, list[bytes]] = {}
        self.counts: Counter[str] = Counter()
        """Frames dropped by reason, handshakes refused, strangers' disconnects."""

    def use_secret(self, secret: bytes) -> None:
        self.keys = {role: derive_key(secret, role) for role in ROLES}

    # ---------------------------------------------------------------- liveness
    def _drain_monitor(self) -> None:
        while self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            ev = recv_monitor_message(self.monitor)
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._generation[fd] = self._generation.get(fd, 0) + 1
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                gen = self._generation.get(fd, 0)
                gone = [p for p in self.peers.values() if p.fd == fd and p.generation == gen]
                for p in gone:
                    del self.peers[p.routing_id]
                self._lost += gone
                if not gone:
                    self.counts["stranger disconnects"] += 1

    def lost(self) -> list[Peer]:
        """Authenticated peers whose connection closed since the last call."""
        self._drain_monitor()
        out, self._lost = self._lost, []
        return out

    # ---------------------------------------------------------------- frames
    def take(self) -> list[tuple[Peer, str, list]]:
        """Every frame waiting (non-blocking): handshakes handled here, strangers' frames dropped,
        the authenticated peers' messages returned in arrival order."""
        out, sock = [], self.sock
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # (cheaper than a receive that raises Again)
            parts = sock.recv_multipart(copy=False)
            rid = parts[0].bytes
            peer = self.peers.get(rid)
            if peer is None:
                if len(parts) == 2:
                    self._handshake(rid, parts[1])
                else:
                    self.counts["malformed"] += 1
                continue
            for frame in parts[1:]:  # a peer may send several messages as one (one wake-up here)
                try:
                    kind, fields = decode(frame.bytes)
                except MessageError as e:
                    self.counts[str(e)] += 1
                    continue
                out.append((peer, kind, fields))
        self._expire()
        return out

    def send(self, peer: Peer, frame: bytes) -> bool:
        """Queue ``frame`` for ``peer``: ``flush`` sends each peer's frames as one message."""
        out = self._out.get(peer)
        if out is None:
            self._out[peer] = [frame]
        else:
            out.append(frame)
        return True

    def flush(self) -> None:
        """Send what was queued; a peer that is gone is reported by ``lost``."""
        queued, self._out = self._out, {}
        for peer, frames in queued.items():
            try:
                self.sock.send_multipart([peer.routing_id, *frames], zmq.NOBLOCK)
            except zmq.ZMQError:
                self.counts["undeliverable"] += 1

    def _handshake(self, rid: bytes, frame: zmq.Frame) -> None:
        if rid in self._refused:
            self.counts["unauthenticated"] += 1
            return
        try:
            kind, fields = decode(frame.bytes, PRE_AUTH_MAX_BYTES, _PRE_AUTH)
        except MessageError as e:
            self.counts[f"pre-auth {e}"] += 1
            return
        if kind == "hello":
            self._hello(rid, fields)
        else:
            self._proof(rid, fields, frame)

    def _hello(self, rid: bytes, fields: list) -> None:
        version, role, name, nonce = fields
        if version != VERSION or type(role) is not str or role not in self.keys or type(name) is not str or type(nonce) is not bytes \
                or len(nonce) != 32 or rid in self._pending:
            self.counts["bad hello"] += 1
            return
        mine = secrets.token_bytes(32)
        self._pending[rid] = (role, name, nonce, mine, time.monotonic())
        if len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
        self._reply(rid, encode("challenge", mine, _mac(self.keys[role], b"listener", role, name, nonce, mine)))

    def _proof(self, rid: bytes, fields: list, frame: zmq.Frame) -> None:
        pend = self._pending.pop(rid, None)
        if pend is None or type(fields[0]) is not bytes or not hmac.compare_digest(
                fields[0], _mac(self.keys[pend[0]], b"peer", *pend[:4])):
            self.counts["refused"] += 1
            self._refused[rid] = None
            if len(self._refused) > 4096:
                self._refused.popitem(last=False)
            return
        self._drain_monitor()  # this connection's ACCEPTED came before its first frame
        fd = frame.get(zmq.SRCFD)
        peer = self.peers[rid] = Peer(rid, pend[0], pend[1], fd, self._generation.get(fd, 0))
        self.counts["authenticated"] += 1
        self._reply(rid, encode("welcome", self._welcome(peer)))

    def _reply(self, rid: bytes, frame: bytes) -> None:
        try:
            self.sock.send_multipart([rid, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counts["undeliverable"] += 1

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            rid, pend = next(iter(self._pending.items()))
            if now - pend[4] < HANDSHAKE_TIMEOUT_S:
                break
            del self._pending[rid]
            self.counts["handshake timeout"] += 1

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


class PeerSocket:
    """An engine's or a client's connection to the coordinator at ``address``, authenticated on
    construction (``AuthError``: refused or nobody answered within ``timeout_s``)."""

    def __init__(self, address: str, secret: bytes, role: str, name: str, timeout_s: float = 30.0,
                 ctx: zmq.Context | None = None):
        self.address = address
        self.ctx = ctx or zmq.Context.instance()
        self.sock = _socket(self.ctx, zmq.DEALER)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self.lost = False
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)
        try:
            self.welcome = self._authenticate(derive_key(secret, role), role, name, timeout_s)
        except BaseException:
            self.close()
            raise

    def _authenticate(self, key: bytes, role: str, name: str, timeout_s: float) -> Any:
        mine = secrets.token_bytes(32)
        self.sock.send(encode("hello", VERSION, role, name, mine))
        theirs, mac = self._expect("challenge", timeout_s)
        if type(theirs) is not bytes or type(mac) is not bytes or not hmac.compare_digest(
                mac, _mac(key, b"listener", role, name, mine, theirs)):
            raise AuthError(f"the coordinator at {self.address} does not hold this secret (a wrong secret, or not "
                            "the coordinator meant)")
        self.sock.send(encode("proof", _mac(key, b"peer", role, name, mine, theirs)))
        return self._expect("welcome", timeout_s)[0]

    def _expect(self, kind: str, timeout_s: float) -> list:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AuthError(f"the coordinator at {self.address} refused this process or did not answer within "
                            f"{timeout_s:.0f} s: a wrong secret (set MEGATRON_ASYNC_CLIENT_SECRET to the coordinator's), "
                            "or nothing listens there")
        try:
            return decode(self.sock.recv(), PRE_AUTH_MAX_BYTES * 64, frozenset({kind}))[1]
        except MessageError as e:
            raise AuthError(f"unexpected answer from {self.address} while connecting ({e})") from None

    def send(self, kind: str, *fields: Any) -> None:
        self.sock.send(encode(kind, *fields))

    def send_frames(self, frames: list[bytes]) -> None:
        """Several encoded messages as one (the coordinator reads them in order)."""
        self.sock.send_multipart(frames)

    def take(self) -> list[tuple[str, list]]:
        """Every message waiting (non-blocking); marks ``lost`` when the connection closed."""
        out, sock = [], self.sock
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # (cheaper than a receive that raises Again)
            for frame in sock.recv_multipart():
                try:
                    out.append(decode(frame))
                except MessageError:
                    continue
        if self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            recv_monitor_message(self.monitor)
            self.lost = True
        return out

    def wait(self, timeout_s: float) -> None:
        """Until a message or the connection's end arrives, or ``timeout_s``."""
        self._poller.poll(int(timeout_s * 1000))

    def close(self) -> None:
        """What was sent still goes out (up to a second) unless the coordinator is gone."""
        if not self.sock.closed:
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0 if self.lost else 1000)
