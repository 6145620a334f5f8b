"""An engine without a model, for measuring the coordinator and the client: every request it
takes ends at its next step with one token, so what a request costs end to end is the routing,
the messages and the bookkeeping around the engine, not the engine. It speaks to the
coordinator through the real engine link (megatron_async/dp_engine/link.py).

    python -m benchmarks.null_engine tcp://127.0.0.1:PORT [NAME]
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from megatron_async.inference.engines.engine_stats import EngineStats
from megatron_async.inference.engines.step_result import StepResult
from megatron_async.inference.request import RequestOutput, RequestUpdate


@dataclass
class _Allocator:
    enable_prefix_caching: bool = True
    hash_key: bytes = b"NullModel"
    capacity: int = 1 << 20
    num_available: int = 1 << 20

    def record_evictions(self) -> list:
        return []  # a null engine caches nothing


@dataclass
class _Context:
    block_size: int = 16
    allocator: _Allocator = field(default_factory=_Allocator)


class NullEngine:
    """The part of ``DynamicInferenceEngine`` the engine link uses."""

    def __init__(self, block_size: int = 16):
        self.context = _Context(block_size)
        self.stats = EngineStats()
        self.is_paused = False
        self._queued: list[tuple[int, list[int]]] = []
        self._aborted: set[int] = set()
        self._next = 0

    def add_request(self, prompt, params=None, prompt_digests: bytes = b"") -> int:
        rid, self._next = self._next, self._next + 1
        self._queued.append((rid, prompt if isinstance(prompt, list) else []))
        return rid

    def abort_request(self, rid: int) -> bool:
        self._aborted.add(rid)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._queued)

    def step(self) -> StepResult:
        out = StepResult(step_id=self.stats.steps)
        for rid, prompt in self._queued:
            reason = "abort" if rid in self._aborted else "length"
            out.updates.append(RequestUpdate(rid, (0,), None, True, reason))
            out.finished.append(RequestOutput(rid, prompt, [0], None, reason, weight_versions=[0]))
        self._queued, self._aborted = [], set()
        self.stats.steps += 1
        return out


def main(argv: list[str] | None = None) -> int:
    from megatron_async.dp_engine.join import CoordinatorChannel
    from megatron_async.dp_engine.link import EngineLink

    argv = sys.argv[1:] if argv is None else argv
    address, name = argv[0], argv[1] if len(argv) > 1 else "null"
    channel = CoordinatorChannel(address, name)
    link = EngineLink(NullEngine(), channel, max_requests=1 << 16, name=name)
    print(f"megatron_async.serve: engine {channel.register(link.info())} of the coordinator at {address}", flush=True)
    link.run()
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
