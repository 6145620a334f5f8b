"""The engine-side socket of the front-ends (serve/bridge.py) takes only front-ends that proved
the server's secret, and from them only the messages a front-end sends, each through its checked
reader: garbage, an unknown type, another socket's type, an oversized frame, a bad field, a
pickle, and a stranger's frames are dropped and counted by reason (and shown on /metrics), nothing
they carry runs, and the bridge keeps serving the real front-end. A submission or admin call
whose fields its reader refuses is answered as refused (its handler never waits for ever)."""
import os
import pickle
import time

import msgpack
import pytest

zmq = pytest.importorskip("zmq")

from megatron_async.inference.communication import wire  # noqa: E402
from megatron_async.inference.communication.handshake import AuthError, authenticate  # noqa: E402
from megatron_async.inference.request import InvalidRequestError, SamplingParams  # noqa: E402
from megatron_async.serve import ipc  # noqa: E402
from megatron_async.serve.bridge import Bridge  # noqa: E402
from megatron_async.serve.metrics import ServerMetrics  # noqa: E402
from megatron_async.serve.submission import Choice  # noqa: E402

MAX_FRAME = 4096


class StubLoop:
    """The engine loop as the bridge uses it; ``call`` runs its job at once (the test's thread
    stands for the engine thread)."""

    def __init__(self):
        self.metrics = ServerMetrics("m")
        self.submitted, self.aborted, self.admin = [], [], []

    def submit(self, sub):
        self.submitted.append(sub)

    def abort(self, sub):
        self.aborted.append(sub)

    def is_alive(self):
        return True

    def run_admin(self, op, args, reply):
        self.admin.append((op, args))
        reply((200, {"op": op}))

    def call(self, job):
        job()


@pytest.fixture
def bridge():
    loop, ends = StubLoop(), ipc.Endpoints.create()
    b = Bridge(loop, ends, 1, MAX_FRAME)
    ctx = zmq.Context()
    events = ctx.socket(zmq.PULL)
    events.bind(ends.events(0))
    b.start()
    socks = []

    def dealer():
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ends.bridge)
        socks.append(s)
        return s

    try:
        yield b, loop, ends, dealer, events
    finally:
        for s in (*socks, events):
            s.close(0)
        b.stop()
        ctx.term()
        ends.remove()


def ask(sock, sid: int, what: str = "health"):
    sock.send(wire.encode(ipc.QUERY, sid, what))
    assert sock.poll(10_000), "no reply"
    mtype, fields = wire.decode(sock.recv(), 1 << 20)
    assert mtype is ipc.REPLY
    return mtype.read(fields)


def wait_for(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


def add(sid: int, prompt=(1, 2, 3)) -> bytes:
    return ipc.encode_add(sid, [Choice(list(prompt), SamplingParams(num_tokens_to_generate=2))], 1.0)


def test_bad_frames_are_dropped_counted_and_the_front_end_keeps_being_served(bridge, tmp_path):
    b, loop, ends, dealer, events = bridge
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {canary}",)

    stranger = dealer()  # connects, never proves the secret
    for frame in (b"\xc1garbage", msgpack.packb([127, 1]), add(0), add(1, range(100)), pickle.dumps(Evil())):
        stranger.send(frame)
    assert wait_for(lambda: b.wire_stats.frames >= 5)

    front = dealer()
    authenticate(front, b.secret, ipc.ROLE, "0", ends.job)
    sent = {"undecodable": [b"\xc1garbage", pickle.dumps(Evil())], "unknown type": [msgpack.packb([127, 1])],
            "oversized": [add(2, range(MAX_FRAME))],
            "wrong role": [ipc.encode_entries([]), wire.encode(ipc.REPLY, 1, True)],
            "malformed": [wire.encode(ipc.ABORT, 1, 2), msgpack.packb({"a": 1})],
            "bad field": [wire.encode(ipc.QUERY, "x", "health"), wire.encode(ipc.ADD, 3, 1.0, [b"\0" * 7], [[0, {}]]),
                          wire.encode(ipc.ADMIN, 4, "suspend", {"tags": [[[[[[[[[[["x"]]]]]]]]]]]})]}
    for frames in sent.values():
        for frame in frames:
            front.send(frame)
    front.send(add(5))
    assert ask(front, 6) == [6, True]  # answered after everything sent before it

    # the stranger's are refused from their first bytes: no [type, ...] head (garbage, an unknown
    # type, the pickle), over the 512 bytes of a handshake, or a type a stranger may not send
    strangers = {"malformed": 3, "oversized": 1, "unauthenticated": 1}
    assert b.wire_stats.dropped == {r: len(sent.get(r, ())) + strangers.get(r, 0) for r in {*sent, *strangers}}
    assert b.wire_stats.authenticated == 1
    assert [(s.sid, [c.prompt_tokens for c in s.choices]) for s in loop.submitted] == [(5, [[1, 2, 3]])]
    assert loop.admin == []
    # the refused add and admin call are answered, in order, on the engine thread
    assert events.poll(5000)
    first = ipc.decode_entries(events.recv())
    assert first[0][:2] == (3, "rejected") and isinstance(first[0][2], InvalidRequestError)
    assert events.poll(5000)
    (sid, kind, (status, body)), = ipc.decode_entries(events.recv())
    assert (sid, kind, status) == (4, "admin", 400) and "could not read" in body["error"]["message"]
    metrics = loop.metrics.render().decode()
    assert 'megatron_async_frontend_ipc_dropped_frames_total{model_name="m",reason="unknown type"} 1.0' in metrics
    assert 'reason="unauthenticated"} 1.0' in metrics
    assert not canary.exists()


def test_only_the_servers_secret_joins_and_each_name_once(bridge):
    b, loop, ends, dealer, events = bridge
    with pytest.raises(AuthError):
        authenticate(dealer(), b"not the secret" * 3, ipc.ROLE, "0", ends.job, timeout_s=1)
    with pytest.raises(AuthError):
        authenticate(dealer(), b.secret, ipc.ROLE, "1", ends.job, timeout_s=1)  # one front-end: only "0"
    with pytest.raises(AuthError):
        authenticate(dealer(), b.secret, "client", "0", ends.job, timeout_s=1)  # not this socket's role
    front = dealer()
    authenticate(front, b.secret, ipc.ROLE, "0", ends.job)
    with pytest.raises(AuthError):
        authenticate(dealer(), b.secret, ipc.ROLE, "0", ends.job, timeout_s=1)  # taken
    assert ask(front, 1, "metrics")[1].startswith(b"# HELP")
    assert b.wire_stats.auth_failed == 2 and b.wire_stats.authenticated == 1


def test_the_bridge_handles_exactly_what_a_front_end_sends(bridge):
    b = bridge[0]
    assert set(b._handlers) == ipc.FRONTEND_SENDS
