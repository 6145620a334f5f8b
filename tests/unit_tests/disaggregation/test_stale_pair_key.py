"""A pair key whose connection was refused is spent: the coordinator (disaggregation/handoffs.py,
played here in process, its messages through the wire's checked readers) gives the pair a new
one, and every transfer still on its way with the old key fails at once, ending its request once
with "error": an import the decode engine receives after it refused that key (no blocks
allocated, no receive posted), and a send the coordinator asked of the prefill engine before it
heard of the refusal (the decode engine marked the key spent in its store). The blocks come back
on both engines, which then hand off the next request on the new key, its tokens one engine's.
Every wait is for the state it checks (the links are turned until it comes)."""
from __future__ import annotations

import torch

from megatron_async.config import DpRouting
from megatron_async.coordinator import messages
from megatron_async.coordinator.core import CoordinatorCore
from megatron_async.coordinator.engines import EngineInfo
from megatron_async.disaggregation.engine_side import _tag
from megatron_async.disaggregation.pair_auth import mac_key
from megatron_async.disaggregation.transfer import PairChannel
from megatron_async.inference.records import encode_sampling
from megatron_async.inference.request import RequestUpdate
from tests.helpers.handoff_links import PARAMS, PROMPTS, Link, llm, until
from tests.unit_tests.coordinator.test_coordinator_core import Outbox


class Cluster:
    """The coordinator's core between a prefill and a decode engine's ``Link``; messages move only
    when the test moves them."""

    def __init__(self):
        self.p, self.d = Link(llm(), "prefill"), Link(llm(), "decode")
        self.box = Outbox()
        self.core = CoordinatorCore(self.box, DpRouting.LOAD_BALANCED)
        self.ps = self.core.engine_registered("peer0", EngineInfo("p", 4, 64, 4, b"m", True, "prefill", "", "gloo"))
        self.ds = self.core.engine_registered("peer1", EngineInfo("d", 4, 64, 4, b"m", True, "decode",
                                                                  self.d.handoffs.kv_address, "gloo"))
        self.core.client_joined("c")
        self.box.take()
        self.finished: dict[int, list] = {}

    def to_engines(self, msgs) -> None:
        for index, kind, *fields in msgs:
            link = self.p if index == self.ps.index else self.d
            name, fields = messages.decode(messages.encode(kind, *fields))
            link.handoffs.prefill(fields) if name == "prefill" else link.handoffs.handle(name, fields)

    def to_core(self, link, *kinds) -> None:
        """The engine's messages of ``kinds`` to the coordinator, in the order it sent them."""
        slot = self.ps if link is self.p else self.ds
        sent, link.channel.sent = link.channel.sent, [m for m in link.channel.sent if m[0] not in kinds]
        for kind, *fields in (m for m in sent if m[0] in kinds):
            self.core.engine_message(slot, kind, fields)

    def take(self) -> list:
        """The coordinator's engine messages; its client messages' final outputs are recorded."""
        engine, client = self.box.take()
        for _, kind, *fields in client:
            if kind == "finished":
                for out in fields[0]:
                    self.finished.setdefault(out.request_id, []).append(out)
        return engine

    def prefilled(self, client_rid: int, first_token: int) -> list:
        """A request's prompt computed on the prefill engine: the coordinator's kv_import for it."""
        self.core.submit("c", client_rid, PROMPTS[client_rid], [encode_sampling(PARAMS)], stream=False)
        (prefill,) = self.take()
        self.to_engines([prefill])
        rid = prefill[2]
        (_, _, blocks, version), = until(lambda: self.p.channel.take("kv_ready"), [self.p])
        self.core.engine_outputs(self.ps, 1, [RequestUpdate(rid, (first_token,), None, False, None)], [])
        self.core.engine_message(self.ps, "kv_ready", [rid, blocks, version])
        (imp,) = self.take()
        assert imp[:3] == (self.ds.index, "kv_import", rid)
        return imp


def test_transfers_on_a_refused_pair_key_fail_once_and_the_engines_serve_on():
    want = [o.generated_tokens for o in llm(8).generate(PROMPTS, PARAMS)]
    c = Cluster()
    p, d = c.p, c.d
    imp0, imp1 = c.prefilled(0, want[0][0]), c.prefilled(1, want[1][0])
    old = imp0[13]
    assert imp1[13] == old  # both on their way with the pair's key

    c.to_engines([imp0])
    until(lambda: any(m[0] == "kv_accepted" for m in d.channel.sent), [d])
    stranger = PairChannel(old[0], old[1], 0, "gloo", torch.device("cpu"))  # the store prefix, not the key
    stranger._mac_key = mac_key("a guess")
    stranger.send(_tag(imp0[2]), torch.zeros(d.handoffs.layout.nbytes(imp0[12]), dtype=torch.uint8))
    until(lambda: any(m[0] == "kv_failed" for m in d.channel.sent), [d])  # refused before any block moved
    assert until(lambda: stranger.take_done(), [])[0][2] is not None
    stranger.close()
    c.to_core(d, "kv_accepted", "kv_failed")  # the coordinator hears of the refusal after it asked for the send
    send0, release0 = c.take()
    assert send0[1:4] == ("kv_send", imp0[2], (old[0], old[1], 0, "gloo")) and release0[1:3] == ("kv_release", imp0[2])

    imp2 = c.prefilled(2, want[2][0])  # the next transfer: the pair's new key
    new = imp2[13][0]
    assert new != old[0]

    c.to_engines([imp1])  # the import already on its way with the refused key
    (failed,) = until(lambda: d.channel.take("kv_failed"), [d])
    assert failed[1] == imp1[2] and "refused or broke" in failed[2], failed
    assert not d.channel.take("kv_accepted") and not d.handoffs.receiving and not d.handoffs.channels
    c.core.engine_message(c.ds, "kv_failed", list(failed[1:]))
    (release1,) = c.take()
    assert release1[1:3] == ("kv_release", imp1[2])
    assert c.core.handoffs._pair_keys[c.ps.index, c.ds.index] == new  # (the old key's failure leaves the new one)

    c.to_engines([send0, release0, release1])  # a send on the refused key: the decode engine marked it spent
    until(lambda: not p.handoffs.in_flight() and not p.handoffs.channels, [p])
    assert p.handoffs.kv_sent_blocks == 0 and not p.channel.take("kv_failed")
    assert "ConnectionRefusedError" in p.handoffs.spent[old[0]]  # (refused at the store, not at a timeout)
    assert list(p.handoffs.ready) == [imp2[2]]  # (only the next transfer's blocks are kept)
    assert c.core.counts["kv_failed"] == 2 and list(c.core.handoffs.transfers) == [imp2[2]]
    assert {rid: [o.finish_reason for o in outs] for rid, outs in c.finished.items()} == {0: ["error"], 1: ["error"]}
    alloc = d.engine.context.allocator
    assert alloc.num_available == alloc.capacity and not d.engine.has_unfinished_requests()

    c.to_engines([imp2])  # the engines serve on: the next hand-off, on the new key
    until(lambda: any(m[0] == "kv_accepted" for m in d.channel.sent), [d])
    c.to_core(d, "kv_accepted")
    c.to_engines(c.take())
    until(lambda: any(m[0] == "kv_imported" for m in d.channel.sent), [p, d])
    c.to_core(d, "kv_imported")
    c.to_engines(c.take())  # kv_release
    outputs = {}

    def done():
        res = d.turn()
        for out in (res.finished if res else []):
            outputs[d.rid_of.pop(out.request_id)] = out.generated_tokens
        return imp2[2] in outputs

    until(done, [p])
    assert outputs == {imp2[2]: want[2]} and c.core.counts["kv_handoffs"] == 1 and c.core.counts["kv_failed"] == 2
    until(lambda: not p.handoffs.in_flight(), [p])
    for link in (p, d):
        alloc = link.engine.context.allocator
        assert alloc.num_available == alloc.capacity
        link.handoffs.close()
