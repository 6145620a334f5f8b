"""Run one engine configuration of a side-by-side benchmark in a process of its own on a GPU.

The memory plan gives an engine most of the device; one built after it in the same process finds
that memory still held (graph pools, caches) and runs out. A spawned process per configuration
starts from an empty device. On CPU the call runs in place."""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch


def in_own_process(device: str | torch.device, fn, *args):
    """``fn(*args)``, in a spawned process when ``device`` is CUDA (``fn`` and ``args`` picklable)."""
    if torch.device(device).type != "cuda":
        return fn(*args)
    torch.cuda.empty_cache()  # the parent's measurement buffers
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
