"""GPU idle share of decode, measured two ways over windows of decode-only engine steps.

1. torch.profiler (CUDA activity): 1 - (union of device busy intervals) / (span of the window).
   Idle time is every gap between kernels, including the ~1 us launch gaps inside a CUDA graph.
   The profiler's launch callbacks add host time (on an H100 they made the host as slow as the
   device), so this is an upper bound.
2. CUDA events, no profiler: every launch is timed from its first enqueued work to its sample
   copy (the events run on the stream, no host sync), and 1 - sum(step device time) / wall time
   is the share of the window in which the device had no step to run: the device waiting for
   the host, which launch-ahead is meant to remove."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_async.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_async.inference.request import SamplingParams

BUSY_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``[start, end)`` intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def idle_share(intervals: list[tuple[float, float]]) -> float | None:
    """1 - busy / span over the span of ``intervals``; None when there is no activity."""
    if not intervals:
        return None
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    return 1.0 - union_length(intervals) / span if span > 0 else 0.0


def device_intervals(trace: dict) -> list[tuple[float, float]]:
    """Busy ``(start_us, end_us)`` intervals of the device events in a chrome trace."""
    return [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in BUSY_CATEGORIES
    ]


@dataclass(frozen=True)
class DecodeProfile:
    batch: int
    steps: int
    decode_only_steps: int
    idle_share: float | None
    """None on CPU (no device timeline) or without the profiler."""
    span_ms: float | None
    busy_ms: float | None
    host_ms_per_step: float
    trace_path: str | None
    event_idle_share: float | None = None
    """Method 2 (CUDA events, no profiler); None on CPU."""


def _fill_decode_batch(engine: DynamicInferenceEngine, batch: int, prompt_len: int, num_tokens: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = engine.controller.model.vocab_size
    sp = SamplingParams(top_k=1, num_tokens_to_generate=num_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(0, vocab, size=prompt_len).tolist(), sp)


def profile_decode_steps(
    engine: DynamicInferenceEngine,
    batch: int,
    prompt_len: int,
    steps: int,
    warmup_steps: int = 10,
    trace_path: str | Path | None = None,
    record_cpu: bool = False,
    use_profiler: bool = True,
    seed: int = 0,
) -> DecodeProfile:
    """Admit ``batch`` requests, decode until ``warmup_steps`` decode-only steps passed, then
    profile ``steps`` steps; the requests are run to completion afterwards. The engine must
    be idle on entry. ``record_cpu`` adds host ops to the trace (more profiler overhead)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("profile_decode_steps needs an idle engine")
    batch = max(1, min(batch, engine.config.max_requests))
    _fill_decode_batch(engine, batch, prompt_len, warmup_steps + 2 * steps + 2, seed)
    decode_seen = 0
    while decode_seen < warmup_steps:
        if not engine.has_unfinished_requests():
            raise RuntimeError("the requests finished before the decode window (raise steps or num_tokens)")
        decode_seen += engine.step().is_decode_only
    is_cuda = engine.context.device.is_cuda
    activities = [torch.profiler.ProfilerActivity.CUDA] if is_cuda else []
    if record_cpu or not is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    decode_only = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")  # one window: nothing to keep
        with torch.profiler.profile(activities=activities) if use_profiler else contextlib.nullcontext() as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                decode_only += engine.step().is_decode_only
            engine.context.device.synchronize()
            host_ms = 1e3 * (time.perf_counter() - t0) / max(1, steps)
    event_share = _event_idle_share(engine, steps) if is_cuda else None
    engine.run_until_done()
    share = span_ms = busy_ms = None
    saved = None
    if prof is not None:
        saved = _export(prof, trace_path)
        if is_cuda:
            with open(saved) as f:
                intervals = device_intervals(json.load(f))
            share = idle_share(intervals)
            if intervals:
                span_ms = (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e3
                busy_ms = union_length(intervals) / 1e3
        if trace_path is None:
            os.unlink(saved)
            saved = None
    return DecodeProfile(batch, steps, decode_only, share, span_ms, busy_ms, host_ms, saved, event_share)


def _event_idle_share(engine: DynamicInferenceEngine, steps: int) -> float | None:
    """Method 2 over ``steps`` more steps of the running decode batch."""
    stats = engine.stats
    engine.time_all_launches = True
    try:
        engine.step()  # the launch in flight was not timed: land it
        engine.context.device.synchronize()
        timed0, device0 = stats.timed_steps, stats.timed_device_time
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()  # returns once the launch it bookkeeps has landed: no extra sync
        wall = time.perf_counter() - t0
    finally:
        engine.time_all_launches = False
    if stats.timed_steps - timed0 < steps or wall <= 0:
        return None
    return max(0.0, 1.0 - (stats.timed_device_time - device0) / wall)


def _export(prof: torch.profiler.profile, trace_path: str | Path | None) -> str:
    if trace_path is None:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
    else:
        path = str(trace_path)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(path)
    return path
