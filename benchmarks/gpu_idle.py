"""GPU idle share from device-side intervals of a real run (torch.profiler, i.e. CUPTI).

A run is profiled with CUDA activity only (kernel, memcpy and memset intervals as the device
executed them); idle = 1 - (union of busy intervals) / (wall span), never clamped.

Per-launch windows: every launch starts with exactly one copy of the bookkeeping snapshot
(``context.layout.nbytes`` bytes) into its device views: device-to-device from the staging
buffer on CUDA (the host-to-device copy into staging runs earlier, on a copy stream; see
``ContextGPUView``), host-to-device where there is no staging. On the device, launch k's window
runs from its snapshot copy to launch k+1's; the gap between its last kernel and the next copy is
the time the device waited for the host. Windows of decode-only launches give the decode
idle share; the whole run's span gives the run idle share.

The profiler adds host time per launch (CUPTI callbacks), so the profiled run is a second,
identical run after the timed one; its throughput is reported next to the timed run's so the
perturbation is visible."""
from __future__ import annotations

import gc
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

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


@dataclass(frozen=True)
class DeviceEvent:
    start: float
    end: float
    """Microseconds on the device clock."""
    is_snapshot_copy: bool
    """The copy of exactly the bookkeeping snapshot's size into the device views that starts a
    launch (device-to-device when the trace has such copies, else host-to-device)."""


def device_events(trace: dict, snapshot_bytes: int | None = None) -> list[DeviceEvent]:
    """Busy device events of a chrome trace, in start order."""
    raw = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in BUSY_CATEGORIES:
            continue
        start, name = float(e["ts"]), e.get("name", "")
        sized = (snapshot_bytes is not None and e.get("cat") == "gpu_memcpy"
                 and int(e.get("args", {}).get("bytes", -1)) == snapshot_bytes)
        kind = ("DtoD" if "DtoD" in name else "HtoD" if "HtoD" in name else None) if sized else None
        raw.append((start, start + float(e.get("dur", 0.0)), kind))
    starts_launch = "DtoD" if any(k == "DtoD" for _, _, k in raw) else "HtoD"
    return sorted((DeviceEvent(s, t, k == starts_launch) for s, t, k in raw), key=lambda d: d.start)


def device_intervals(trace: dict) -> list[tuple[float, float]]:
    """Busy ``(start_us, end_us)`` intervals of the device events in a chrome trace."""
    return [(d.start, d.end) for d in device_events(trace)]


@dataclass(frozen=True)
class IdleReport:
    run_idle_share: float | None
    """Whole profiled run: 1 - busy / span."""
    decode_idle_share: float | None
    """Decode-only launch windows only; None when launches could not be matched to windows."""
    span_ms: float
    busy_ms: float
    decode_window_ms: float
    launches: int
    snapshot_copies: int
    """Should equal ``launches``; otherwise the per-launch windows are not trusted."""
    note: str = ""


def idle_report(events: list[DeviceEvent], decode_only: list[bool]) -> IdleReport:
    """Idle shares of a profiled run whose k-th launch was decode-only iff ``decode_only[k]``."""
    if not events:
        return IdleReport(None, None, 0.0, 0.0, 0.0, len(decode_only), 0, "no device activity recorded")
    intervals = [(d.start, d.end) for d in events]
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    busy = union_length(intervals)
    starts = [d.start for d in events if d.is_snapshot_copy]
    run_idle = 1.0 - busy / span if span > 0 else 0.0
    if len(starts) != len(decode_only):
        return IdleReport(run_idle, None, span / 1e3, busy / 1e3, 0.0, len(decode_only), len(starts),
                          f"{len(starts)} snapshot copies for {len(decode_only)} launches: no per-launch windows")
    ends = starts[1:] + [max(e for _, e in intervals)]
    window = idle = 0.0
    for k, (a, b) in enumerate(zip(starts, ends)):
        if not decode_only[k] or b <= a:
            continue
        inside = [(max(s, a), min(e, b)) for s, e in intervals if e > a and s < b]
        window += b - a
        idle += (b - a) - union_length(inside)
    dec = idle / window if window > 0 else None
    return IdleReport(run_idle, dec, span / 1e3, busy / 1e3, window / 1e3, len(decode_only), len(starts))


def profile_run(engine, run: Callable[[], object], trace_path: str | None = None) -> tuple[object, IdleReport | None]:
    """Call ``run()`` (which drives ``engine``) under the CUDA profiler; returns its result and
    the idle report (None on CPU, where there is no device timeline). ``trace_path`` keeps the
    chrome trace (open in https://ui.perfetto.dev)."""
    if not engine.context.device.is_cuda:
        return run(), None
    launch_plan = engine.launch_plan
    decode_only: list[bool] = []

    def recording_launch(*a, **kw):
        pending = launch_plan(*a, **kw)
        decode_only.append(pending.is_decode_only)
        return pending

    engine.launch_plan = recording_launch  # this instance only, for this run only
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                result = run()
                torch.cuda.synchronize()
    finally:
        del engine.launch_plan
    if trace_path is None:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
    else:
        path = trace_path
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        if trace_path is None:
            os.unlink(path)
    events = device_events(trace, engine.context.layout.nbytes)
    del prof, trace
    gc.collect()  # the profiler's objects, collected here rather than as a pause in the next timed run
    return result, idle_report(events, decode_only)
