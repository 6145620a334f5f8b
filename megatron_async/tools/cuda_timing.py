"""Timing helper shared by the kernel check scripts (CUDA only)."""
from __future__ import annotations

import statistics
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
