"""Drive an engine through a workload: requests are added at their arrival step and wall-clock
arrival time, every ``engine.step()`` is timed on the host (in steady async decode that equals
the device step), and each token's landing time on the host gives TTFT and inter-token latency."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from megatron_async.cli.progress import ProgressBar
from megatron_async.cli.workload import WorkloadRequest
from megatron_async.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_async.inference.engines.engine_stats import EngineStats
from megatron_async.inference.request import InvalidRequestError, RequestOutput, SamplingParams

# Counters the engine copies into its stats as running totals (scheduler, consensus exchange).
_CUMULATIVE_STATS = ("paused", "evicted", "prefix_hit_tokens", "spec_off_rows", "consensus_rounds", "consensus_time",
                     "lora_free_steps", "lora_free_graph_replays", "long_tile_steps", "long_tile_graph_replays")


@dataclass(frozen=True)
class StepRecord:
    t: float
    """Seconds since the run started, at the end of the step."""
    seconds: float
    """Host wall time of the ``engine.step()`` call."""
    num_rows: int
    decode_only: bool


@dataclass
class RequestTiming:
    """Seconds since the run started, on the host, at step granularity."""

    arrival: float
    """When the request arrived (its add may come later: ``admission_queue_short``)."""
    first_token: float | None = None
    """End of the step that delivered the request's first token."""
    finished: float | None = None
    num_tokens: int = 0
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)
    """Seconds between the steps that delivered consecutive tokens (one entry per token after
    the first)."""

    def record(self, num_new: int, t: float) -> None:
        """``num_new`` tokens landed at time ``t`` (several in one step have gaps of 0)."""
        if not num_new:
            return
        if self.first_token is None:
            self.first_token = t
        else:
            self.gaps.append(t - self.last_token)
        self.gaps.extend([0.0] * (num_new - 1))
        self.last_token = t
        self.num_tokens += num_new

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None below two tokens)."""
        if self.finished is None or self.first_token is None or self.num_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.num_tokens - 1)


@dataclass
class WorkloadRun:
    outputs: list[RequestOutput | None]
    """``outputs[i]`` belongs to the i-th workload request (None: unfinished at a timeout)."""
    wall_time: float
    steps: list[StepRecord] = field(default_factory=list)
    timed_out: bool = False
    timings: list[RequestTiming | None] = field(default_factory=list)
    """``timings[i]``: the i-th request's latencies (None: rejected at admission)."""

    @property
    def output_tokens(self) -> int:
        return sum(len(o.generated_tokens) for o in self.outputs if o is not None)

    @property
    def mean_decode_batch(self) -> float:
        rows = [s.num_rows for s in self.steps if s.decode_only]
        return sum(rows) / len(rows) if rows else 0.0

    @property
    def first_token_s(self) -> float | None:
        """Seconds from the run's start to the first token of any request."""
        firsts = [t.first_token for t in self.timings if t is not None and t.first_token is not None]
        return min(firsts) if firsts else None

    @property
    def ttft(self) -> list[float]:
        """Seconds from each request's arrival (its ``add_request``) to its first token on the host."""
        return [t.ttft for t in self.timings if t is not None and t.ttft is not None]

    @property
    def tpot(self) -> list[float]:
        """Each finished request's mean time per output token after the first."""
        return [t.tpot for t in self.timings if t is not None and t.tpot is not None]

    @property
    def itl(self) -> list[float]:
        """Seconds between consecutive tokens of a request landing on the host (all requests)."""
        return [g for t in self.timings if t is not None for g in t.gaps]

    def latency_ms(self) -> dict[str, float | None]:
        """TTFT, TPOT and inter-token latency p50 / p99 in ms (None without samples)."""
        out = {}
        for name, xs in (("ttft", self.ttft), ("tpot", self.tpot), ("itl", self.itl)):
            for q in (50, 99):
                out[f"{name}_p{q}_ms"] = float(1e3 * np.percentile(xs, q)) if xs else None
        return out


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

    A request arrives once ``arrival_step`` steps ran and ``arrival_time`` seconds passed, and is
    added when the engine's queue is short (``admission_queue_short``); an idle engine sleeps
    until the next arrival. TTFT counts from the arrival. A request the engine rejects at admission gets
    an output with ``finish_reason="error"``."""
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_step, requests[i].arrival_time))
    outputs: dict[int, RequestOutput] = {}
    timings: dict[int, RequestTiming] = {}  # by request id
    index_of: dict[int, int] = {}
    ready: deque[tuple[int, float]] = deque()  # arrived, not yet added: (index, arrival time)
    run = WorkloadRun([], 0.0)
    nxt, step, tokens = 0, 0, 0
    t0 = time.perf_counter()
    while nxt < len(order) or ready or engine.has_unfinished_requests():
        if not ready and not engine.has_unfinished_requests():
            head = requests[order[nxt]]
            step = max(step, head.arrival_step)  # idle engine: jump to the next arrival
            wait = head.arrival_time - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
        now = time.perf_counter() - t0
        while nxt < len(order) and requests[order[nxt]].arrival_step <= step and requests[order[nxt]].arrival_time <= now:
            i = order[nxt]
            nxt += 1
            # latency counts from the arrival (a timed arrival's own time), not from the add
            ready.append((i, now if requests[i].arrival_step > 0 else requests[i].arrival_time))
        # add while the engine's queue could take more in its next step; the rest is validated
        # and added between later steps, while the GPU runs the ones launched
        while ready and engine.admission_queue_short():
            i, arrived = ready.popleft()
            try:
                rid = engine.add_request(requests[i].prompt, make_params(requests[i]))
                index_of[rid] = i
                timings[rid] = RequestTiming(arrived)
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
        for upd in res.updates:
            timings[upd.request_id].record(len(upd.new_tokens), te - t0)
            tokens += len(upd.new_tokens)
        for out in res.finished:
            outputs[index_of[out.request_id]] = out
            timings[out.request_id].finished = te - t0
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
    by_index = {i: timings[rid] for rid, i in index_of.items()}
    run.timings = [by_index.get(i) for i in range(len(requests))]
    return run
