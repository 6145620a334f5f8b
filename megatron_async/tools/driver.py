"""Drive an engine through a workload: requests are added at their arrival step, and every
``engine.step()`` is timed on the host (in steady async decode that equals the device step)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from megatron_async.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_async.inference.engines.engine_stats import EngineStats
from megatron_async.inference.request import InvalidRequestError, RequestOutput, SamplingParams
from megatron_async.tools.progress import ProgressBar
from megatron_async.tools.workload import WorkloadRequest

# Scheduler counters the engine copies into its stats as running totals.
_CUMULATIVE_STATS = ("paused", "evicted", "prefix_hit_tokens")


@dataclass(frozen=True)
class StepRecord:
    t: float
    """Seconds since the run started, at the end of the step."""
    seconds: float
    """Host wall time of the ``engine.step()`` call."""
    num_rows: int
    decode_only: bool


@dataclass
class WorkloadRun:
    outputs: list[RequestOutput | None]
    """``outputs[i]`` belongs to the i-th workload request (None: unfinished at a timeout)."""
    wall_time: float
    steps: list[StepRecord] = field(default_factory=list)
    timed_out: bool = False

    @property
    def output_tokens(self) -> int:
        return sum(len(o.generated_tokens) for o in self.outputs if o is not None)

    @property
    def mean_decode_batch(self) -> float:
        rows = [s.num_rows for s in self.steps if s.decode_only]
        return sum(rows) / len(rows) if rows else 0.0


class StatsWindow:
    """Counts engine events from its creation on (e.g. after a warm-up run): it gives the
    engine a fresh EngineStats and re-bases the running totals the engine copies in."""

    def __init__(self, engine: DynamicInferenceEngine):
        self.engine = engine
        self._base = {k: getattr(engine.stats, k) for k in _CUMULATIVE_STATS}
        engine.stats = EngineStats()

    def stats(self) -> EngineStats:
        st = replace(self.engine.stats)
        for k, base in self._base.items():
            setattr(st, k, getattr(st, k) - base)
        return st


def run_workload(
    engine: DynamicInferenceEngine,
    requests: list[WorkloadRequest],
    make_params: Callable[[WorkloadRequest], SamplingParams],
    progress: ProgressBar | None = None,
    deadline: float | None = None,
) -> WorkloadRun:
    """Run ``requests`` to completion (or until ``deadline``, a ``time.perf_counter()`` value).

    A request the engine rejects at admission gets an output with ``finish_reason="error"``."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_step)
    outputs: dict[int, RequestOutput] = {}
    index_of: dict[int, int] = {}
    run = WorkloadRun([], 0.0)
    nxt, step, tokens = 0, 0, 0
    t0 = time.perf_counter()
    while nxt < len(order) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            step = max(step, requests[order[nxt]].arrival_step)  # idle engine: jump to the next arrival
        while nxt < len(order) and requests[order[nxt]].arrival_step <= step:
            i = order[nxt]
            nxt += 1
            try:
                index_of[engine.add_request(requests[i].prompt, make_params(requests[i]))] = i
            except InvalidRequestError as e:
                outputs[i] = RequestOutput(-1, list(requests[i].prompt), [], None, "error", error=str(e))
        if not engine.has_unfinished_requests():
            continue
        ts = time.perf_counter()
        res = engine.step()
        te = time.perf_counter()
        if res.step_id < 0 and engine.has_unfinished_requests():  # TP / EP: an agreed "yes" may be one step stale
            raise RuntimeError("engine.step() ran nothing while requests were unfinished")
        run.steps.append(StepRecord(te - t0, te - ts, res.num_rows, res.is_decode_only))
        for out in res.finished:
            outputs[index_of[out.request_id]] = out
            tokens += len(out.generated_tokens)
        if progress is not None:
            progress.update(len(outputs), tokens)
        step += 1
        if deadline is not None and te > deadline:
            run.timed_out = True
            break
    run.wall_time = time.perf_counter() - t0
    if progress is not None:
        progress.update(len(outputs), tokens, force=True)
        progress.close()
    run.outputs = [outputs.get(i) for i in range(len(requests))]
    return run
