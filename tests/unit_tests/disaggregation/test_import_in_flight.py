"""A decode engine keeps stepping its running requests while an import is in flight: the
transfer (chunked through a staging buffer far smaller than the request's blocks) is held on its
connection's thread by a test hook, after its bytes moved and before it is handed back, until the
test has seen decode steps complete; then the request joins, and every token equals one engine's.
Over a real gloo pair connection between two engines of this process; on a GPU (``gpu``) the
engines' pools are CUDA memory and the transfer runs on the connection's own stream, staged through
pinned host memory.

    python -m pytest -q -m gpu tests/unit_tests/disaggregation/test_import_in_flight.py"""
from __future__ import annotations

import threading
import time

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.records import encode_sampling
from tests.helpers.handoff_links import Link

PARAMS = SamplingParams(temperature=0.9, seed=4, num_tokens_to_generate=40, ignore_eos=True)
SHORT = [(7 * j) % 100 + 1 for j in range(6)]
LONG = [(5 * j) % 100 + 1 for j in range(41)]  # 11 blocks of 4
STEPS_IN_FLIGHT = 6


def _turn_until(check, link, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        res = link.turn()
        if value := check(res):
            return value
    raise AssertionError(f"never: {what}")


def _hand_off(p, d, rid, prompt, first, pair):
    sampling = encode_sampling(PARAMS)
    p.handoffs.prefill([rid, rid + 1, prompt, sampling, False, b"", None])
    (_, _, blocks, version), = _turn_until(lambda _: p.channel.take("kv_ready"), p, "kv_ready")
    d.handoffs.handle("kv_import", [rid, rid + 1, prompt, sampling, False, b"", None, first, None, version, blocks,
                                    pair])
    (_, _, hit), = _turn_until(lambda _: d.channel.take("kv_accepted"), d, "kv_accepted")
    p.handoffs.handle("kv_send", [rid, pair[:2] + (0, "gloo"), hit])
    return blocks


def llm(device: str, max_requests: int = 4) -> LLM:
    config = InferenceConfig(block_size_tokens=4, num_kv_blocks=64, max_requests=max_requests, max_tokens=64,
                             cuda_graphs=False)
    return LLM(None, device, "float32", config)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_steps_go_on_while_an_import_is_in_flight(device):
    want = [o.generated_tokens for o in llm(device, 8).generate([SHORT, LONG], PARAMS)]
    p, d = Link(llm(device), "prefill"), Link(llm(device), "decode")
    chunk = 2 * d.handoffs.layout.block_bytes()
    p.handoffs.chunk_bytes = d.handoffs.chunk_bytes = chunk  # (both ends chunk alike)
    entered, gate = threading.Event(), threading.Event()

    def hold(kind, tag):
        if kind == "recv_blocks" and tag == 1:
            entered.set()
            if not gate.wait(60):
                raise TimeoutError("the test never let the transfer land")

    d.handoffs.transfer_hook = hold
    pair = ("kv-test-in-flight", d.handoffs.kv_address, 1, "gloo")
    _hand_off(p, d, 0, SHORT, want[0][:1], pair)
    _turn_until(lambda _: d.channel.take("kv_imported"), d, "the first import")
    p.handoffs.handle("kv_release", [0])

    blocks = _hand_off(p, d, 1, LONG, want[1][:1], pair)
    assert len(d.handoffs.layout.chunks(blocks, chunk)) >= 5  # (the staging holds 2 blocks: many chunks)
    assert entered.wait(60)  # every chunk received and scattered; not yet handed back
    start = d.engine.stats.decode_steps
    outputs = {}
    for _ in range(STEPS_IN_FLIGHT):
        res = d.turn()
        assert res is not None and not res.finished and res.updates
        assert 1 in d.handoffs.receiving and not d.channel.take("kv_imported")
    assert d.engine.stats.decode_steps - start == STEPS_IN_FLIGHT  # the running request kept decoding
    gate.set()
    assert _turn_until(lambda _: d.channel.take("kv_imported"), d, "the held import") == [("kv_imported", 1, blocks)]
    p.handoffs.handle("kv_release", [1])

    def finished(res):
        for out in (res.finished if res else []):
            outputs[d.rid_of.pop(out.request_id)] = out.generated_tokens
        return len(outputs) == 2

    _turn_until(finished, d, "both requests' end")
    assert outputs == {0: want[0], 1: want[1]} and d.engine.stats.prefill_steps == 0
    landed = d.handoffs.counters()
    assert landed["kv_imports_landed"] == 2 and landed["kv_import_seconds"] > 0 and landed["kv_loop_seconds"] > 0
    _turn_until(lambda _: p.handoffs.kv_sent_blocks == d.handoffs.kv_received_blocks, p, "the sends' ends")
    assert p.handoffs.counters()["kv_transfer_bytes"] == d.handoffs.layout.nbytes(blocks) + \
        d.handoffs.layout.nbytes(-(-len(SHORT) // 4))
    for link in (p, d):
        alloc = link.engine.context.allocator
        assert alloc.num_available == alloc.capacity
        link.handoffs.close()
