"""A prefill engine starts a kv_send that arrives while its step runs, before the step ends
(disaggregation/mid_step.py), and holds every other message for its next turn in arrival order:
a kv_send never goes before a message about its own request, another kv_send or a control
operation. The device's wait is played by a fake ``wait_host`` that delivers the messages
during a step; the prefill engine is a real EngineLink, the decode engine a ``Link`` over a real
gloo pair connection, and the tokens equal one engine's."""
from __future__ import annotations

import threading
import time

from megatron_async.disaggregation.mid_step import MidStepSends
from megatron_async.dp_engine.link import EngineLink
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.records import encode_sampling
from tests.helpers.handoff_links import PARAMS, PROMPTS, Channel, Link, llm, until

LONG = [(7 * j) % 100 + 1 for j in range(40)]


class Pipe(Channel):
    """The coordinator connection as the link reads it: messages to deliver (``inbox``) besides those sent."""

    def __init__(self):
        super().__init__()
        self.inbox, self.lost = [], False

    def poll(self, timeout_s):
        out, self.inbox = self.inbox, []
        return out


def _prefill_link():
    pipe = Pipe()
    p = EngineLink(llm().engine, pipe, 4, "p", role="prefill", kv_transfer_backend="gloo", address="tcp://127.0.0.1:1",
                   kv_send_mid_step=True)
    return p, pipe


def _ready(p, pipe, rid, prompt, sampling):
    pipe.inbox.append(("prefill", [rid, rid + 1, prompt, sampling, False, b"", None]))
    (_, _, blocks, version), = until(lambda: pipe.take("kv_ready"), [p])
    return blocks, version


def _during_next_step(p, monkeypatch, messages, until_passed):
    """The next launch's wait delivers ``messages``; what the engine had taken when the wait
    ended (still inside its step)."""
    device, seen = p.engine.context.device, {}

    def wait_host(event):
        if seen:
            return
        p.channel.inbox += messages
        deadline = time.monotonic() + 30.0
        device.while_waiting(lambda: until_passed() or time.monotonic() > deadline)
        seen.update(sending=dict(p.handoffs.sending), held=list(p.handoffs.mid_step.held))

    monkeypatch.setattr(device, "wait_host", wait_host)
    return seen


def test_a_kv_send_arriving_during_a_step_starts_before_the_step_ends(monkeypatch):
    want = [o.generated_tokens for o in llm(8).generate(PROMPTS, PARAMS)]
    sampling = encode_sampling(PARAMS)
    p, pipe = _prefill_link()
    d = Link(llm(), "decode")
    blocks, version = _ready(p, pipe, 0, PROMPTS[0], sampling)
    pair = ("kv-test-mid-step", d.handoffs.kv_address, 1, "gloo")
    d.handoffs.handle("kv_import", [0, 1, PROMPTS[0], sampling, False, b"", None, want[0][:1], None, version, blocks,
                                    pair])
    (_, _, cached), = until(lambda: d.channel.take("kv_accepted"), [d])
    later = ("prefill", [1, 2, PROMPTS[1], sampling, False, b"", None])  # (arrives first: held for the turn)
    seen = _during_next_step(p, monkeypatch, [later, ("kv_send", [0, pair[:2] + (0, "gloo"), cached])],
                             lambda: bool(p.handoffs.sending))
    pipe.inbox.append(("prefill", [2, 3, LONG, sampling, False, b"", None]))  # the step the send arrives in
    p.turn()
    assert len(seen["sending"]) == 1 and seen["held"] == [later]  # (taken inside the step)
    assert p.handoffs.counters()["kv_sends_mid_step"] == 1 and not p.handoffs.unsent - {2}
    p.turn()
    assert 1 in p._engine_id or any(m[0] == "kv_ready" and m[1] == 1 for m in pipe.sent)  # (the held one, handled)
    until(lambda: d.channel.take("kv_imported"), [p, d])
    pipe.inbox.append(("kv_release", [0]))
    outputs = {}

    def decoded():
        res = d.turn()
        for out in (res.finished if res else []):
            outputs[d.rid_of.pop(out.request_id)] = out.generated_tokens
        return 0 in outputs

    until(decoded, [p])
    assert outputs == {0: want[0]}
    for _, rid, *_ in until(lambda: len(p.handoffs.ready) == 2 and pipe.take("kv_ready") or None, [p]):
        pipe.inbox.append(("kv_release", [rid]))
    until(lambda: not p.handoffs.ready, [p])
    for link in (p, d):
        alloc = link.engine.context.allocator
        assert alloc.num_available == alloc.capacity
        link.handoffs.close()


def test_a_kv_send_after_its_requests_release_waits_for_the_turn(monkeypatch):
    """kv_release then kv_send of one request during a step: both are held and handled in that
    order (the send finds no blocks: kv_failed), no connection made, the blocks freed once."""
    sampling = encode_sampling(PARAMS)
    p, pipe = _prefill_link()
    _ready(p, pipe, 0, PROMPTS[0], sampling)
    pair = ("kv-test-order", "127.0.0.1:1", 0, "gloo")
    msgs = [("kv_release", [0]), ("kv_send", [0, pair, 0])]
    seen = _during_next_step(p, monkeypatch, msgs, lambda: False)
    pipe.inbox.append(("prefill", [1, 2, LONG, sampling, False, b"", None]))
    p.turn()
    assert seen["held"] == msgs and not seen["sending"] and p.handoffs.counters()["kv_sends_mid_step"] == 0
    p.turn()
    assert [m[1] for m in pipe.take("kv_failed")] == [0] and not p.handoffs.channels
    (_, rid, *_), = until(lambda: pipe.take("kv_ready"), [p])
    pipe.inbox.append(("kv_release", [rid]))
    until(lambda: not p.handoffs.ready, [p])
    alloc = p.engine.context.allocator
    assert alloc.num_available == alloc.capacity
    p.handoffs.close()


class _HandOffs:
    def __init__(self):
        self.unsent, self.started = {1, 2, 3, 4, 5, 6}, []

    def handle_now(self, kind, fields):
        self.started.append(fields[0])
        self.unsent.discard(fields[0])


class _Channel:
    lost = False

    def __init__(self, batches):
        self.batches = batches

    def poll(self, timeout_s):
        return self.batches.pop(0) if self.batches else []


def test_which_kv_sends_go_before_held_messages():
    nccl, ipc = ("k", "a", 0, "nccl"), ("k", "a", 0, "ipc")
    batches = [[("route", [9]), ("kv_send", [1, nccl, 0]), ("kv_cancel", [2]), ("kv_send", [2, nccl, 0])],
               [("kv_send", [3, nccl, 0])]]
    h, channel = _HandOffs(), _Channel(batches)
    mid = MidStepSends(channel, threading.Lock(), h)
    mid.wait(lambda: not channel.batches)  # (ends once a kv_send is held: the later ones wait behind it)
    assert channel.batches
    assert h.started == [1] and mid.sends == 1
    assert [m[0] for m in mid.held] == ["route", "kv_cancel", "kv_send"]
    assert [m[0] for m in mid.take_held()] == ["route", "kv_cancel", "kv_send"] and not mid.held
    h2, channel = _HandOffs(), _Channel([[("control", [7, "pause", {}]), ("kv_send", [5, nccl, 0])],
                                         [("kv_send", [6, nccl, 0])]])
    mid = MidStepSends(channel, threading.Lock(), h2)
    mid.wait(lambda: not channel.batches)
    assert h2.started == [] and [m[0] for m in mid.held] == ["control", "kv_send"]  # (never before a control)
    mid.take_held()
    mid.wait(lambda: not channel.batches)  # (the next step: free again; its event passes once all came)
    assert h2.started == [6]
    h3, channel = _HandOffs(), _Channel([[("kv_send", [3, ipc, 0]), ("kv_send", [4, nccl, 0])], [("route", [8])]])
    mid = MidStepSends(channel, threading.Lock(), h3)
    mid.wait(lambda: not channel.batches)  # (an ipc pair's send packs on the compute stream: at the turn)
    assert h3.started == [] and [m[1][0] for m in mid.held] == [3, 4]


def test_wait_host_runs_the_hook_only_while_the_event_has_not_passed():
    class Event:
        def __init__(self, passes_after):
            self.queries, self.passes_after, self.synced = 0, passes_after, False

        def query(self):
            self.queries += 1
            return self.queries > self.passes_after

        def synchronize(self):
            self.synced = True

    device, calls = DeviceFacade("cpu"), []
    device.while_waiting = lambda passed: calls.append(passed())
    done, pending = Event(0), Event(1)
    device.wait_host(done)
    device.wait_host(pending)
    assert calls == [True] and done.synced and pending.synced


def test_switched_off_the_prefill_engine_waits_for_its_turn():
    """``InferenceConfig.kv_send_mid_step`` is on by default; a link built without it installs no hook."""
    from megatron_async import InferenceConfig

    assert InferenceConfig().kv_send_mid_step is True
    p = EngineLink(llm().engine, Pipe(), 4, "p", role="prefill", kv_transfer_backend="gloo",
                   address="tcp://127.0.0.1:1")
    try:
        assert p.handoffs.mid_step is None
        assert p.handoffs.counters()["kv_sends_mid_step"] == 0
    finally:
        p.handoffs.close()
