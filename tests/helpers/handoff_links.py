"""Engines' sides of the hand-off in one process, the coordinator played by the test: ``Link`` is
what EngineHandOffs reads of dp_engine/link.py's EngineLink, its channel records what the engine
sends; ``until`` turns the links until a state comes."""
from __future__ import annotations

import time

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.disaggregation.engine_side import EngineHandOffs
from megatron_async.inference.records import decode_sampling

PARAMS = SamplingParams(temperature=0.9, seed=4, num_tokens_to_generate=8, ignore_eos=True)
PROMPTS = [[(5 * i + j) % 100 + 1 for j in range(6 + 4 * i)] for i in range(3)]


class Channel:
    def __init__(self):
        self.sent: list[tuple] = []

    def send(self, kind, *fields):
        self.sent.append((kind, *fields))

    def take(self, kind):
        found = [m for m in self.sent if m[0] == kind]
        self.sent = [m for m in self.sent if m[0] != kind]
        return found


class Link:
    """What EngineHandOffs reads of dp_engine/link.py's EngineLink."""

    def __init__(self, llm, role, backend="gloo"):
        self.engine, self.channel = llm.engine, Channel()
        self.rid_of: dict[int, int] = {}
        self.aborted: list[int] = []
        self.handoffs = EngineHandOffs(self, role, backend, "tcp://127.0.0.1:1")

    def submit(self, rid, seq, prompt, params, stream, digests=b"", reply=None):
        local = self.engine.add_request(prompt, decode_sampling(params, frozen=False))
        self.rid_of[local] = rid
        return local

    def track(self, rid, seq, local, stream, reply):
        self.rid_of[local] = rid

    def detach(self, local):
        return self.rid_of.pop(local, None)

    def handle(self, kind, fields):
        self.aborted.append(fields[0])

    def turn(self):
        res = self.engine.step() if self.engine.has_unfinished_requests() else None
        if res is not None:
            self.handoffs.landed(res)
        self.handoffs.poll()
        return res


def llm(max_requests=4):
    return LLM(None, "cpu", "float32", InferenceConfig(block_size_tokens=4, num_kv_blocks=64,
                                                       max_requests=max_requests, max_tokens=64))


def until(check, links, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for link in links:
            link.turn()
        if value := check():
            return value
        time.sleep(0.002)
    raise AssertionError("the awaited state never came")
