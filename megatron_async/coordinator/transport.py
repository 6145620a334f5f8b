"""The control plane's sockets on the one wire (communication/wire.py frames, handshake.py's
mutual HMAC challenge-response, roles "engine" and "client"): the coordinator's ROUTER
(``ControlListener``) and an engine's or a client's DEALER (``PeerSocket``).

What the handshake module gives every listener holds here too: a peer proves the role's key
before anything it sends is parsed, a client's key cannot register an engine, a stranger's
frames, connections and closes are dropped and counted (``stats``), and only the close of an
authenticated peer's connection is its departure (``lost``). Control-plane specifics: ZMTP
heartbeats (1 s, 5 s timeout) close the connection of a peer on a host that went silent, which
then reports the same way; a turn's messages to one peer leave as one ZMQ message (``flush``);
a message of the wrong kind for its sender's role is dropped as "wrong role"."""
from __future__ import annotations

from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from megatron_async.coordinator import messages
from megatron_async.coordinator.trust import ENV_SECRET, peer_endpoint
from megatron_async.inference.communication import wire
from megatron_async.inference.communication.handshake import (SNDMORE, AuthError, Listener, Peer, authenticate,
                                                              readable, zmq_poll, zmq_send)

__all__ = ["AuthError", "ControlListener", "Peer", "PeerSocket"]
_SENDS = {"engine": messages.ENGINE_SENDS, "client": messages.CLIENT_SENDS}
"""Who may connect to a coordinator (any name, not unique: engines and clients name themselves
host:pid), and what each may send."""


def control_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.MAXMSGSIZE, messages.MAX_FRAME_BYTES),
                       (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 5000), (zmq.HEARTBEAT_TTL, 6000)):
        sock.setsockopt(opt, value)
    return sock


class ControlListener:
    def __init__(self, address: str, welcome: Callable[[Peer], Any], ctx: zmq.Context | None = None,
                 sends: dict[str, frozenset[str]] | None = None):
        """Bind ``address`` (``tcp://HOST:0`` picks a port; ``bound`` says which); ``use_secret``
        before any peer can be welcome. ``welcome(peer)``: what a peer that proved its key is told.
        ``sends``: role -> the messages its peers may send (the coordinator's: engines' and clients')."""
        self.sends = sends or _SENDS
        self.sock = control_socket(ctx or zmq.Context.instance(), zmq.ROUTER)
        self.listener = Listener(self.sock, None, dict.fromkeys(self.sends), b"", messages.MAX_FRAME_BYTES, welcome)
        self.monitor = self.listener.monitor
        self.stats = self.listener.stats
        try:
            self.sock.bind(address[:-2] + ":*" if address.startswith("tcp://") and address.endswith(":0") else address)
        except BaseException:
            self.close()
            raise
        self.bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._out: dict[Peer, list[bytes]] = {}

    def use_secret(self, secret: bytes) -> None:
        self.listener.use_secret(secret)

    def take(self, waiting: bool | None = None) -> list[tuple[Peer, str, list]]:
        """The authenticated peers' messages waiting (non-blocking), checked: (peer, type name,
        fields). ``waiting``: what the caller's poll said of the socket (None: ask)."""
        out, sends = [], self.sends
        for peer, mtype, fields in self.listener.take(waiting):
            if mtype.name not in sends[peer.role]:
                self.stats.drop("wrong role")
                continue
            try:
                out.append((peer, mtype.name, mtype.read(fields)))  # (messages.read)
            except wire.WireError as e:
                self.stats.drop(e.reason)
        return out

    def lost(self, drain: bool = True) -> list[Peer]:
        """Authenticated peers whose connection closed since the last call (``drain=False``: the
        caller's poll found no event of the monitor)."""
        return self.listener.lost(drain)

    def send(self, peer: Peer, frame: bytes) -> None:
        """Queued: ``flush`` sends each peer's frames as one message."""
        self._out.setdefault(peer, []).append(frame)

    def flush(self) -> None:
        """Send what was queued; a peer that is gone is reported by ``lost``."""
        queued, self._out = self._out, {}
        for peer, frames in queued.items():
            self.listener.send_many(peer, frames, block=False)

    def close(self) -> None:
        self.listener.close()
        self.sock.close(0)


class PeerSocket:
    """An engine's or a client's connection to the coordinator at ``address`` (through its ipc
    twin when one listens on this host: trust.py), authenticated on construction (``AuthError``:
    refused, or nobody answered within ``timeout_s``)."""

    def __init__(self, address: str, secret: bytes, role: str, name: str, timeout_s: float = 30.0,
                 ctx: zmq.Context | None = None):
        self.address = address
        self._ctx = None if ctx is not None else zmq.Context()  # its own: ``close`` waits for what was sent
        self.sock = control_socket(ctx or self._ctx, zmq.DEALER)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.lost = False
        self.stats = wire.WireStats()
        """What the coordinator sent that did not decode (a newer coordinator's message types)."""
        self._in, self._monitor_in = readable(self.sock), readable(self.monitor)
        self._either = self._in + self._monitor_in
        try:
            self.endpoint = peer_endpoint(address)
            self.sock.connect(self.endpoint)
            self.welcome = authenticate(self.sock, secret, role, name, b"", timeout_s)
        except AuthError as e:
            self.close()
            raise AuthError(f"the coordinator at {address}: {e} (the control plane's secret: {ENV_SECRET})") from None
        except BaseException:
            self.close()
            raise

    def send(self, name: str, *fields: Any) -> None:
        zmq_send(self.sock, messages.encode(name, *fields), 0)

    def send_frames(self, frames: list[bytes]) -> None:
        """Several encoded messages as one (the coordinator reads them in order)."""
        sock = self.sock
        for frame in frames[:-1]:
            zmq_send(sock, frame, SNDMORE)
        zmq_send(sock, frames[-1], 0)

    def take(self, ready: list | None = None) -> list[tuple[str, list]]:
        """Every message waiting (non-blocking), checked; marks ``lost`` when the connection closed.
        ``ready``: what ``wait`` returned (the sockets' state is not asked again)."""
        out, sock, stats = [], self.sock, self.stats
        recv, poll_in = sock.recv, self._in
        if ready is None:
            ready = zmq_poll(self._either, 0)
        known = ended = False
        for which, _ in ready:
            if which is sock:
                known = True
            else:
                ended = True
        while known or zmq_poll(poll_in, 0):  # (cheaper than a receive that raises Again; true between a message's parts too)
            known = False
            frame = recv()  # each part is a message of its own
            stats.frames += 1
            try:
                name, fields = messages.decode(frame)
            except wire.WireError as e:
                stats.drop(e.reason)
                continue
            if name in messages.COORDINATOR_SENDS:
                out.append((name, fields))
            else:
                stats.drop("wrong role")
        if ended:
            recv_monitor_message(self.monitor)
            self.lost = True
        return out

    def gone(self) -> bool:
        """The connection closed (read from its monitor alone: whatever else waits stays)."""
        if not self.lost and zmq_poll(self._monitor_in, 0):
            recv_monitor_message(self.monitor)
            self.lost = True
        return self.lost

    def readable(self) -> bool:
        """A message is waiting (a send may take the descriptor's readable edge: ask after one)."""
        return bool(zmq_poll(self._in, 0))

    def wait(self, timeout_s: float) -> list:
        """Until a message or the connection's end arrives, or ``timeout_s``: what is ready (for ``take``)."""
        return zmq_poll(self._either, int(timeout_s * 1000))

    def close(self) -> None:
        """What was sent still goes out (up to a second: an engine's last "leave" reaches the
        coordinator before its process exits) unless the coordinator is gone."""
        if not self.sock.closed:
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0 if self.lost else 1000)
            if self._ctx is not None:
                self._ctx.term()
