"""The control plane's trust rules: loopback by default, a non-loopback address only with a
configured secret, a client or engine without the secret refused and changing nothing, a
stranger's frames dropped and counted; messages round-trip without pickle, and a message
of the wrong kind for its sender is dropped."""
from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from megatron_async.coordinator import messages
from megatron_async.coordinator.engines import EngineInfo
from megatron_async.coordinator.server import CoordinatorServer
from megatron_async.coordinator.transport import AuthError, PeerSocket
from megatron_async.coordinator.trust import (ENV_SECRET, SecretError, ipc_twin, is_local, peer_endpoint, peer_secret,
                                              secret_file)
from megatron_async.inference.communication import wire
from megatron_async.inference.communication.handshake import HELLO, PROOF
from megatron_async.inference.records import encode_sampling, sampling_fields
from megatron_async.inference.request import RequestOutput, RequestUpdate, SamplingParams


def test_same_user_clients_connect_and_others_are_refused_changing_nothing(server):
    path = secret_file(server.address)
    assert path.stat().st_mode & 0o777 == 0o600
    peer = PeerSocket(server.address, peer_secret(server.address), "client", "me", 5)
    assert peer.welcome["policy"] == "load_balanced"
    peer.close()
    with pytest.raises(AuthError, match="does not hold this engine's key"):
        PeerSocket(server.address, b"not the secret, long enough", "engine", "intruder", 5)
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)  # goes on regardless: a made-up proof
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    raw.send(wire.encode(HELLO, 1, "engine", "intruder", b"n" * 32))
    assert raw.poll(5000) and wire.decode(raw.recv(), 512)[0].name == "challenge"
    raw.send(wire.encode(PROOF, b"m" * 32))
    raw.send(messages.encode("register", EngineInfo("intruder", 8, 100, 16, b"k", True)))
    peer = PeerSocket(server.address, peer_secret(server.address), "client", "me", 5)  # a round trip later
    peer.close()
    raw.close()
    assert not server.core.engines.slots
    st = server.listener.stats
    # the made-up proof refused, the register after it unread (the wrong secret stopped at the challenge)
    assert st.auth_failed == 1 and st.dropped["unauthenticated"] == 1


def test_local_peers_connect_through_the_ipc_twin_which_goes_with_the_coordinator(monkeypatch, runtime_dir):
    """A coordinator on loopback TCP listens on a Unix socket beside its secret file too, and its
    engines and clients given the TCP address connect there; it is removed at close."""
    monkeypatch.delenv(ENV_SECRET, raising=False)
    s = CoordinatorServer("tcp://127.0.0.1:0")
    twin = ipc_twin(s.address)
    assert twin.parent == secret_file(s.address).parent and twin.parent.stat().st_mode & 0o777 == 0o700
    stop = threading.Event()
    t = threading.Thread(target=s.serve, args=(stop,), daemon=True)
    t.start()
    try:
        peer = PeerSocket(s.address, peer_secret(s.address), "client", "me", 5)
        peer.close()
        assert peer.endpoint == peer_endpoint(s.address) == f"ipc://{twin}" and peer.welcome["engines"] == 0
        assert s.listener.stats.authenticated == 1
    finally:
        stop.set()
        t.join(5)
        s.close()
    assert not twin.exists() and peer_endpoint(s.address) == s.address  # gone with it: TCP again
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/tmp/" + "x" * 120)  # no room in a socket's name: TCP alone
    assert ipc_twin("tcp://127.0.0.1:5") is None and ipc_twin("tcp://10.1.2.3:5") is None


@pytest.mark.parametrize("via", ["tcp", "ipc twin"])
def test_a_stranger_changes_nothing(server, via):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.address if via == "tcp" else f"ipc://{ipc_twin(server.address)}")
    for frame in (b"\x00" * 3, msgpack.packb([64, ["x", 1, 1, 8, b"k", True]]), b"\x93" + b"\xff" * 600,
                  messages.encode("submit", 0, [1, 2], [{}], False, None, -1)):
        s.send(frame)
    peer = PeerSocket(server.address, peer_secret(server.address), "client", "me", 5)  # served as ever
    peer.close()
    s.close()
    assert not server.core.engines.slots and not server.core.requests.open
    st = server.listener.stats
    deadline = time.monotonic() + 5
    while st.total_dropped < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    # no [type, ...] header; types other than the handshake's before a proof; over the pre-auth size
    assert st.dropped == {"malformed": 1, "unauthenticated": 2, "oversized": 1} and st.authenticated == 1


def test_a_non_loopback_address_needs_a_configured_secret(monkeypatch):
    monkeypatch.delenv(ENV_SECRET, raising=False)
    with pytest.raises(SecretError, match=ENV_SECRET):
        CoordinatorServer("tcp://0.0.0.0:0")
    assert is_local("ipc:///tmp/x") and is_local("tcp://localhost:1") and not is_local("tcp://10.1.2.3:5")
    monkeypatch.setenv(ENV_SECRET, "a shared secret of some length")
    s = CoordinatorServer("tcp://0.0.0.0:0")
    s.close()


def test_messages_round_trip_without_pickle():
    upd = RequestUpdate(3, (1, 2), "ab", True, "stop", (-0.5, -1.0), ({1: -0.5}, {2: -1.0}), (-2.0,), ({7: -2.0},))
    out = RequestOutput(3, [9, 8], [1, 2], "ab", "stop", [-0.5, -1.0], [{1: -0.5}, {2: -1.0}], None, [0, 1],
                        [-2.0], [{7: -2.0}])
    kind, fields = messages.decode(messages.encode("outputs", 4, [upd], [out], [], [(5, "x")], [11], 2, 30, None))
    assert kind == "outputs" and fields[1] == [upd] and fields[4] == [(5, "x")]
    relayed = fields[2][0]  # checked, passed on to its client as it came, under the client's id
    relayed.request_id = 6
    out.request_id = 6
    assert fields[2] == [relayed] and messages.decode(messages.encode("finished", [relayed]))[1] == [[out]]
    info = EngineInfo("e", 8, 100, 16, b"key", True)
    assert messages.decode(messages.encode("register", info))[1] == [info]
    sp = SamplingParams(top_k=1, stop_words=["a", [1, 2]], seed=3, logit_bias={5: -1.0})
    back = SamplingParams(**sampling_fields(encode_sampling(sp)))
    assert back.stop_words == ("a", (1, 2)) and back.logit_bias == {5: -1.0} and (back.top_k, back.seed) == (1, 3)
    with pytest.raises(wire.WireError):
        sampling_fields({"no_such_field": 1})
    for bad in (b"", b"\xc1", msgpack.packb([999]), msgpack.packb([36, 1, 2]), msgpack.packb({"a": 1}),
                msgpack.packb([64, ["e", "8", 100, 16, b"k", True]]), msgpack.packb([38, "1"])):
        with pytest.raises(wire.WireError):
            messages.decode(bad)


def test_a_message_of_the_wrong_role_is_dropped(server):
    """A client cannot register an engine or send outputs; an engine cannot submit."""
    client = PeerSocket(server.address, peer_secret(server.address), "client", "me", 5)
    client.send("register", EngineInfo("fake", 8, 100, 16, b"k", True))
    client.send("heartbeat", 1, 1)
    engine = PeerSocket(server.address, peer_secret(server.address), "engine", "e", 5)
    engine.send("submit", 0, [1, 2], [{}], False, None, -1)
    client.close()
    engine.close()
    st = server.listener.stats
    deadline = time.monotonic() + 5
    while st.dropped["wrong role"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st.dropped["wrong role"] == 3 and not server.core.engines.slots and not server.core.requests.open
    assert server.wire_counts()["dropped"] == {"wrong role": 3}  # what client.engines()["wire"] reports
