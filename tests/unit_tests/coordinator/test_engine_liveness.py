"""An engine that hangs with its connection open is dead after the coordinator's engine timeout:
its requests are routed again or end with the dead engine's error, the other engines keep
serving, and what it sends when it wakes up is dropped and counted. An engine inside a long step
keeps sending heartbeats from a thread of its own and is not declared dead, unless that step
outlasts its watchdog. The coordinator runs on a thread with its real sockets; engines are stub
peers (authenticated, registered, then silent) or a real engine link over the tiny model."""
from __future__ import annotations

import threading
import time

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.coordinator.engines import EngineInfo
from megatron_async.coordinator.server import CoordinatorServer
from megatron_async.coordinator.transport import PeerSocket
from megatron_async.coordinator.trust import ENV_SECRET, peer_secret
from megatron_async.inference.records import encode_sampling
from megatron_async.inference.request import RequestOutput, RequestUpdate
from megatron_async.dp_engine import link as engine_link
from megatron_async.dp_engine.join import join

TIMEOUT_S = 1.5
MARGIN_S = 2.5
"""The coordinator checks at least once a second (its loop's tick); the rest is a loaded machine's slack."""


@pytest.fixture
def start_server(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv(ENV_SECRET, raising=False)
    started = []

    def start(**kw):
        s = CoordinatorServer("tcp://127.0.0.1:0", engine_timeout_s=TIMEOUT_S, **kw)
        stop = threading.Event()
        t = threading.Thread(target=s.serve, args=(stop,), daemon=True)
        t.start()
        started.append((s, stop, t))
        return s

    yield start
    for s, stop, t in started:
        stop.set()
        t.join(5)
        s.close()


def peer(server, role, name):
    return PeerSocket(server.address, peer_secret(server.address), role, name, 5)


def stub_engine(server, name):
    p = peer(server, "engine", name)
    p.send("register", EngineInfo(name, 8, 100, 4, b"k", True))
    assert wait_for(p, lambda m: m[0] == "info")[1][0]["index"] >= 0
    return p


class Beats:
    """A stub engine's heartbeats, sent whenever the test waits."""

    def __init__(self, engine):
        self.engine, self.last = engine, 0.0

    def __call__(self):
        if time.monotonic() - self.last > 0.2:
            self.engine.send("heartbeat", 0, 100)
            self.last = time.monotonic()


def receive(p, until, timeout_s=10.0, beat=lambda: None):
    """``p``'s messages as they arrive, until one satisfies ``until`` (yielded last)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beat()
        p.wait(0.05)
        for m in p.take():
            yield m
            if until(m):
                return
    raise AssertionError("nothing satisfying the test arrived in time")


def wait_for(p, until, timeout_s=10.0, beat=lambda: None):
    return list(receive(p, until, timeout_s, beat))[-1]


def submit(client, rid, max_tokens=4):
    client.send("submit", rid, [1, 2, 3], [encode_sampling(SamplingParams(num_tokens_to_generate=max_tokens))],
                False, None, -1)


def test_a_silent_engine_is_declared_dead_its_requests_move_and_its_late_messages_are_dropped(start_server):
    server = start_server()
    silent, alive = stub_engine(server, "silent"), stub_engine(server, "alive")  # indices 0 and 1
    client, beat = peer(server, "client", "c"), Beats(alive)
    for rid in range(3):  # load_balanced, ties to the lowest index: 0 and 2 to "silent", 1 to "alive"
        submit(client, rid)
    routes = [m[1][0] for m in receive(silent, lambda m: m[0] == "route" and m[1][1] == 2, beat=beat)]  # submission numbers
    assert len(routes) == 2
    r0, r2 = routes
    silent.send("outputs", 2, [RequestUpdate(r0, (7,), None, False, None)], [], [], [], [], 1, 90, None)
    last_word = time.monotonic()  # then nothing: hung, with its connection open

    outputs: dict[int, RequestOutput] = {}
    while len(outputs) < 3:  # "alive" finishes what it gets (1, then 2 routed again) and keeps beating
        assert time.monotonic() - last_word < TIMEOUT_S + MARGIN_S + 5, outputs
        beat()
        for kind, fields in alive.take():
            if kind == "route":
                alive.send("outputs", fields[1], [], [RequestOutput(fields[0], [1, 2, 3], [5, 6], None, "length")], [],
                           [], [], 0, 100, None)
        client.wait(0.05)
        for kind, fields in client.take():
            if kind == "finished":
                for out in fields[0]:
                    assert out.request_id not in outputs, "ended twice"
                    outputs[out.request_id] = out
                    if out.request_id == 0:
                        declared_after = time.monotonic() - last_word
    assert TIMEOUT_S < declared_after < TIMEOUT_S + MARGIN_S
    assert (outputs[0].finish_reason, outputs[0].generated_tokens) == ("error", [7])  # its partial output
    assert outputs[0].error.startswith("engine 0 (silent) died (no message from it for")
    assert [(outputs[i].finish_reason, outputs[i].generated_tokens) for i in (1, 2)] == [("length", [5, 6])] * 2
    core = server.core
    assert core.counts["timed_out"] == 1 and core.counts["rerouted"] == 1 and core.counts["failed_by_death"] == 1
    assert [s.name for s in core.engines.live()] == ["alive"]

    # it wakes up: told it was declared dead; what it sends changes nothing and is counted
    assert wait_for(silent, lambda m: m[0] == "rejected", beat=beat)[1][0] == -1
    silent.send("outputs", 2, [], [RequestOutput(r2, [1, 2, 3], [9], None, "length")], [], [], [], 0, 100, None)
    silent.send("heartbeat", 0, 100)
    silent.send("register", EngineInfo("silent", 8, 100, 4, b"k", True))
    deadline = time.monotonic() + 5
    while server.listener.stats.dropped["dead engine"] < 3 and time.monotonic() < deadline:
        beat()
        time.sleep(0.02)
    assert server.wire_counts()["dropped"] == {"dead engine": 3}
    assert [s.name for s in core.engines.live()] == ["alive"] and not core.requests.open
    submit(client, 3)  # the other engine still serves
    wait_for(alive, lambda m: m[0] == "route", beat=beat)
    client.wait(0.3)
    assert not [m for m in client.take() if m[0] == "finished"]  # nothing more about 0-2
    assert core.counts["timed_out"] == 1 and [s.name for s in core.engines.live()] == ["alive"]
    for p in (silent, alive, client):
        p.close()


def tiny_llm():
    cfg = InferenceConfig(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=64, max_sequence_length=64)
    return LLM(None, "cpu", "float32", cfg, default_model="tiny")


@pytest.mark.parametrize("watchdog_s", [engine_link.STEP_WATCHDOG_S, 0.5], ids=["busy", "stuck"])
def test_an_engine_in_a_long_step_keeps_beating_until_its_watchdog(start_server, monkeypatch, watchdog_s):
    """A step of 3x the coordinator's timeout: the engine stays (its request completes) unless
    the step outlasts the engine's watchdog (a hung loop thread): then it is declared dead."""
    monkeypatch.setattr(engine_link, "HEARTBEAT_S", 0.25)
    server = start_server(unrouted_timeout_s=1.0)
    llm = tiny_llm()
    real_step, long_steps = llm.engine.step, []

    def step():
        if not long_steps:
            long_steps.append(time.monotonic())
            time.sleep(3 * TIMEOUT_S)
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    link = join(llm, server.address)
    link.step_watchdog_s = watchdog_s
    link.start()
    client = peer(server, "client", "c")
    submit(client, 0)
    (out,) = wait_for(client, lambda m: m[0] == "finished", 30)[1][0]
    if watchdog_s < TIMEOUT_S:
        link._thread.join(10)  # it ends by itself once its step returns: the coordinator said it is dead
    link.stop()
    link.channel.close()
    client.close()
    llm.close()
    assert long_steps and time.monotonic() - long_steps[0] > 3 * TIMEOUT_S
    if watchdog_s > 3 * TIMEOUT_S:
        assert (out.finish_reason, len(out.generated_tokens)) == ("length", 4)
        assert server.core.counts["timed_out"] == 0 and server.core.counts["heartbeats"] >= 3
        assert link.ended == "left"
    else:  # declared dead in its first step (no token yet): routed again, no engine left to take it
        assert out.finish_reason == "error" and "no engine took requests" in out.error
        assert server.core.counts["timed_out"] == 1 and server.core.counts["rerouted"] == 1
        assert link.ended == "declared dead" and not llm.engine.has_unfinished_requests()
