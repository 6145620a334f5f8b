"""A decode engine's hand-off work never holds its loop for long: a turn admits a bounded number
of imports (the rest in later turns), a pair connection's slow set-up runs on the connection's own
thread while turns stay short, the transfer kernel is warmed at the engine's start (its pool's
bytes unchanged), and ``LoopTimes`` names what the longest turn spent its time on.

    python -m pytest -q -m gpu tests/unit_tests/disaggregation/test_loop_turns.py"""
from __future__ import annotations

import time

import pytest
import torch

from megatron_async import LLM, InferenceConfig
from megatron_async.disaggregation import engine_side
from megatron_async.disaggregation.kv_layout import KVLayout
from megatron_async.disaggregation.loop_times import PARTS, LoopTimes
from megatron_async.disaggregation.transfer import PairChannel
from megatron_async.inference.records import encode_sampling
from tests.helpers.handoff_links import PARAMS, PROMPTS, Link, llm, until

SLOW_SETUP_S = 0.5


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_loop_times_name_the_longest_turns_parts():
    times = LoopTimes()
    with times.timed():
        with times.part("admit"):
            _busy(0.01)
            with times.part("connect"):  # (counts for itself, not for "admit")
                _busy(0.03)
    with times.timed():
        with times.part("land"):
            _busy(0.06)
    with times.part("land"):  # (outside a turn: not counted)
        _busy(0.02)
    c = times.counters()
    assert c["kv_loop_max_seconds"] >= 0.06 and c["kv_loop_longest_land_seconds"] >= 0.06
    assert c["kv_loop_longest_admit_seconds"] == 0.0 and c["kv_loop_longest_connect_seconds"] == 0.0
    assert 0.01 <= c["kv_loop_max_admit_seconds"] < 0.03 <= c["kv_loop_max_connect_seconds"]
    assert c["kv_loop_max_land_seconds"] < 0.075  # (not the 0.02 outside a turn)
    assert abs(sum(c[f"kv_loop_longest_{p}_seconds"] for p in PARTS) - c["kv_loop_max_seconds"]) < 1e-6


def test_turns_admit_a_few_imports_each_and_never_wait_for_a_connections_setup(monkeypatch):
    group = PairChannel._group

    def slow_group(self):
        time.sleep(SLOW_SETUP_S)  # (a NCCL communicator's creation, say)
        return group(self)

    monkeypatch.setattr(PairChannel, "_group", slow_group)
    want = [o.generated_tokens for o in llm(8).generate(PROMPTS, PARAMS)]
    p, d = Link(llm(), "prefill"), Link(llm(), "decode")
    sampling = encode_sampling(PARAMS)
    for rid, prompt in enumerate(PROMPTS):
        p.handoffs.prefill([rid, rid + 1, prompt, sampling, False, b"", None])
    ready = until(lambda: len(p.channel.sent) == 3 and p.channel.take("kv_ready"), [p])
    pair = ("kv-test-turns", d.handoffs.kv_address, 1, "gloo")
    for _, rid, blocks, version in ready:
        d.handoffs.handle("kv_import", [rid, rid + 1, PROMPTS[rid], sampling, False, b"", None, want[rid][:1], None,
                                        version, blocks, pair])
    d.handoffs.poll()
    first = d.channel.take("kv_accepted")
    assert len(first) == engine_side.ADMITS_PER_TURN < 3 and d.handoffs.in_flight()
    d.handoffs.poll()
    accepted = first + d.channel.take("kv_accepted")
    assert sorted(m[1] for m in accepted) == [0, 1, 2]
    for _, rid, hit in accepted:
        p.handoffs.handle("kv_send", [rid, pair[:2] + (0, "gloo"), hit])
    outputs = {}

    def finished():
        res = d.turn()
        for out in (res.finished if res else []):
            outputs[d.rid_of.pop(out.request_id)] = out.generated_tokens
        for m in d.channel.take("kv_imported"):
            p.handoffs.handle("kv_release", [m[1]])
        return len(outputs) == 3

    until(finished, [p])
    assert outputs == dict(enumerate(want))
    channel, = d.handoffs.channels.values()
    assert channel.setup_seconds >= SLOW_SETUP_S  # (it happened, on the connection's thread)
    c = d.handoffs.counters()
    assert c["kv_connect_max_seconds"] >= SLOW_SETUP_S and c["kv_imports_landed"] == 3
    assert c["kv_loop_max_seconds"] < SLOW_SETUP_S / 2, c  # (no turn waited for it)
    for link in (p, d):
        link.handoffs.close()


def test_ended_imports_are_admitted_a_few_per_turn():
    d = Link(llm(), "decode")
    admitted = []
    d.handoffs._imported = lambda rid, fill, error: admitted.append(rid)
    d.handoffs.arrived.extend((rid, None, None) for rid in range(5))
    assert d.handoffs.in_flight()
    d.handoffs.poll()
    assert admitted == list(range(engine_side.LANDS_PER_TURN))
    until(lambda: not d.handoffs.arrived, [d])
    assert admitted == list(range(5)) and not d.handoffs.in_flight()


def test_warm_up_leaves_the_pool_as_it_was():
    engine = llm().engine
    for t in engine.context.kv_caches:
        t.copy_(torch.randn_like(t))
    before = [t.clone() for t in engine.context.kv_caches]
    assert KVLayout(engine.context).warm_up() >= 0
    assert all(torch.equal(a, b) for a, b in zip(before, engine.context.kv_caches))


@pytest.mark.gpu
def test_a_cuda_engine_warms_the_transfer_kernel_at_its_start():
    engine = LLM(None, "cuda", "bfloat16", InferenceConfig(block_size_tokens=16, num_kv_blocks=64, max_requests=4,
                                                          max_tokens=64, cuda_graphs=False)).engine
    for t in engine.context.kv_caches:
        t.copy_(torch.randn_like(t))
    before = [t.clone() for t in engine.context.kv_caches]
    d = Link.__new__(Link)
    d.engine = engine
    handoffs = engine_side.EngineHandOffs(d, "decode", "auto", "tcp://127.0.0.1:1", one_launch=True)
    assert handoffs.warmup_seconds > 0 and handoffs.layout._table is not None
    assert all(torch.equal(a, b) for a, b in zip(before, engine.context.kv_caches))
    start = time.perf_counter()  # (compiled and loaded: a chunk now costs a launch)
    idx = torch.arange(3, dtype=torch.int64, device="cuda")
    buf = torch.empty(3 * handoffs.layout.block_bytes(), dtype=torch.uint8, device="cuda")
    handoffs.layout.pack_into(buf, idx)
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 0.05
