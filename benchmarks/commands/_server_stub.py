"""An engine stand-in for measuring the server alone: each step sleeps ``step_s`` (the GIL
released, as a thread waiting for a GPU step would) and gives every running request one token
with a short text. With it a CPU machine shows what the HTTP path costs per token at GPU-like
step rates, without a model's compute hiding it."""
from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

from megatron_async.inference.engines.step_result import StepResult
from megatron_async.inference.request import RequestOutput, RequestUpdate


class StubEngine:
    def __init__(self, max_requests: int, step_s: float):
        self.max_requests, self.step_s = max_requests, step_s
        self._ids = itertools.count()
        self._steps = itertools.count(1)
        self.waiting: list[int] = []
        self.active: dict[int, list] = {}  # id -> [prompt, tokens, max_tokens]
        self._requests: dict[int, list] = {}
        self.context = SimpleNamespace(active=self.active, allocator=SimpleNamespace(num_available=1, capacity=1))
        self.scheduler = SimpleNamespace(waiting=self.waiting)
        self.config = SimpleNamespace(max_requests=max_requests, priority_aging=16)
        self.validator = SimpleNamespace(check=lambda prompt_tokens, params: None)
        self.control = SimpleNamespace(generation_blocked=lambda: None)
        self.stats = SimpleNamespace(overlap_ratio=1.0, decode_steps=0, overlapped_decode_steps=0, prefill_tokens=0,
                                     shared_prompt_tokens=0, held_steps=0)
        self._aborted: set[int] = set()

    def add_request(self, prompt_tokens, params) -> int:
        rid = next(self._ids)
        self._requests[rid] = [list(prompt_tokens), [], params.num_tokens_to_generate]
        self.waiting.append(rid)
        return rid

    def abort_request(self, rid: int) -> None:
        self._aborted.add(rid)

    def step(self) -> StepResult:
        out = StepResult(step_id=next(self._steps))
        while self.waiting and len(self.active) < self.max_requests:
            rid = self.waiting.pop(0)
            self.active[rid] = self._requests.pop(rid)
        time.sleep(self.step_s)
        for rid, (prompt, tokens, max_tokens) in list(self.active.items()):
            aborted = rid in self._aborted
            if not aborted:
                tokens.append((rid * 31 + len(tokens)) % 1000)
            done = aborted or len(tokens) >= max_tokens
            reason = "abort" if aborted else "length" if done else None
            new = () if aborted else (tokens[-1],)
            out.updates.append(RequestUpdate(rid, new, "" if aborted else f" w{tokens[-1]}", done, reason))
            if done:
                del self.active[rid]
                self._aborted.discard(rid)
                text = "".join(f" w{t}" for t in tokens)
                out.finished.append(RequestOutput(rid, prompt, list(tokens), text, reason))
        out.num_rows = len(out.updates)
        return out
