"""Timing helper shared by the kernel check scripts (CUDA only)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median time of one call between CUDA events, in ms (launch gaps included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def host_us(fn: Callable[[], object], iters: int) -> float:
    """CPU time of one eager call in us (Python + launch), GPU work left in flight."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / iters * 1e6


def capture(fn: Callable[[], object], error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` (static inputs) warmed up twice on a side stream, then captured in a CUDA graph;
    returns the graph and what the captured call returned (tensors the replays overwrite).
    ``error_mode`` "thread_local" when the graph holds NCCL collectives (their watchdog thread)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=error_mode):
        out = fn()
    return graph, out


def graph_replay(fn: Callable[[], object], error_mode: str = "global") -> Callable[[], None]:
    """``fn`` (static inputs) warmed up on a side stream and captured in a CUDA graph; returns its replay."""
    return capture(fn, error_mode)[0].replay


def graph_call_us(fns: list[Callable[[], object]], calls_per_graph: int, replays: int = 5) -> float:
    """Device time per call in us: ``calls_per_graph`` calls cycling through ``fns`` (e.g. one
    per layer's weight, so weights come from DRAM as in a step) captured in one graph, replayed,
    event-timed."""
    replay = graph_replay(lambda: [fns[i % len(fns)]() for i in range(calls_per_graph)])
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls_per_graph * replays)
