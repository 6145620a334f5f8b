"""The authenticated handshake (handshake.py) on real ZMQ sockets in one process: the listener
is pumped by a thread, peers and strangers are DEALERs."""
from __future__ import annotations

import os
import pickle
import threading
import time

import pytest
import zmq

from megatron_async.inference.communication import wire
from megatron_async.inference.communication.handshake import (HELLO, PROOF, AuthError, Listener, PeerLost,
                                                              authenticate)

SECRET = b"s" * 32
PING = wire.message_type("test ping", 122, arity=1)


class Pump:
    """A listener on ``ipc://`` in ``tmp_path``, taking frames on a thread until ``stop``."""

    def __init__(self, tmp_path, roles, secret=SECRET, job=b"job"):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"ipc://{tmp_path}/l"
        self.sock.bind(self.address)
        self.listener = Listener(self.sock, secret, roles, job=job, welcome=lambda p: {"hi": p.name})
        self.got, self.lost = [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.sock.poll(20)
            self.got += [(p.role, p.name, m.name, fields) for p, m, fields in self.listener.take()]
            self.lost += [(p.role, p.name) for p in self.listener.lost()]

    def peer(self, role, name, secret=SECRET, job=b"job", timeout_s=3.0):
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            return sock, authenticate(sock, secret, role, name, job, timeout_s)
        except AuthError:
            sock.close(0)
            raise

    def settle(self, until, timeout_s=5.0):
        deadline = time.monotonic() + timeout_s
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)
        return until()

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.listener.close()
        self.ctx.destroy(0)


@pytest.fixture
def pump(tmp_path):
    p = Pump(tmp_path, {"rank": {"1", "2"}, "client": None})
    yield p
    p.stop()


def test_peers_that_prove_the_key_are_welcomed_and_heard(pump):
    sock, welcome = pump.peer("rank", "1")
    assert welcome == {"hi": "1"}
    sock.send(wire.encode(PING, 5))
    assert pump.settle(lambda: pump.got == [("rank", "1", "test ping", [5])])
    c, _ = pump.peer("client", "anyone")
    c2, _ = pump.peer("client", "anyone")  # names of an unrestricted role need not be unique
    assert pump.listener.stats.authenticated == 3
    for s in (sock, c, c2):
        s.close(0)


def test_a_wrong_secret_a_wrong_role_a_taken_name_are_refused(pump):
    with pytest.raises(AuthError, match="does not hold"):
        pump.peer("rank", "1", secret=b"x" * 32)
    with pytest.raises(AuthError, match="does not hold"):
        pump.peer("rank", "1", job=b"another job")
    with pytest.raises(AuthError, match="no welcome"):
        pump.peer("rank", "3", timeout_s=0.5)  # not one of this job's names
    with pytest.raises(AuthError, match="no challenge"):
        pump.peer("engine", "0", timeout_s=0.5)  # a role this listener does not take
    first, _ = pump.peer("rank", "2")
    with pytest.raises(AuthError, match="no welcome"):
        pump.peer("rank", "2", timeout_s=0.5)
    assert pump.listener.stats.auth_failed == 2
    assert [p.name for p in pump.listener.peers.values()] == ["2"]
    first.close(0)


def test_a_peer_detects_a_listener_without_the_key(tmp_path):
    fake = Pump(tmp_path, {"rank": None}, secret=b"f" * 32)
    try:
        with pytest.raises(AuthError, match="does not hold"):
            fake.peer("rank", "1")
    finally:
        fake.stop()


def test_strangers_frames_and_disconnects_change_nothing(pump, tmp_path):
    rank, _ = pump.peer("rank", "1")
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {canary}",)

    for frames in ([b"\0" + os.urandom(63)], [pickle.dumps(Evil())], [wire.encode(PING, 1)],
                   [wire.encode(HELLO, 1, "rank", "2", b"n" * 32), wire.encode(PROOF, b"m" * 32), wire.encode(PING, 7)],
                   [wire.encode(HELLO, 1, "rank", "2", b"n" * 32), wire.encode(PING, 9)], [b"x" * 100_000]):
        s = pump.ctx.socket(zmq.DEALER)
        s.connect(pump.address)
        for fr in frames:
            s.send(fr)
        time.sleep(0.05)
        s.close(0)
    assert pump.settle(lambda: pump.listener.stats.stranger_disconnects >= 6)
    rank.send(wire.encode(PING, 2))
    assert pump.settle(lambda: pump.got == [("rank", "1", "test ping", [2])])
    st = pump.listener.stats
    assert pump.lost == [] and st.auth_failed == 1 and not canary.exists()
    # random bytes and the pickle: no [type, ...] header; the PINGs before a proof: not parsed
    assert st.dropped == {"malformed": 2, "unauthenticated": 3, "oversized": 1}
    late, _ = pump.peer("rank", "2")  # the name the stranger tried is still free
    rank.close(0)
    late.close(0)
    assert pump.settle(lambda: sorted(pump.lost) == [("rank", "1"), ("rank", "2")])


def test_check_alive_raises_for_a_bound_peer_only(pump):
    rank, _ = pump.peer("rank", "1")
    stranger = pump.ctx.socket(zmq.DEALER)
    stranger.connect(pump.address)
    stranger.send(b"hi")
    time.sleep(0.1)
    stranger.close(0)
    time.sleep(0.1)
    pump._stop.set()
    pump._thread.join()
    pump.listener.check_alive()  # the stranger's close is no loss
    rank.close(0)
    deadline = time.monotonic() + 5
    with pytest.raises(PeerLost, match="rank 1"):
        while time.monotonic() < deadline:
            pump.listener.check_alive()
            time.sleep(0.01)
    pump._stop.clear()
    pump._thread = threading.Thread(target=lambda: None)
    pump._thread.start()
