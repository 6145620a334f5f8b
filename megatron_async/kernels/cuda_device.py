"""Facts of a CUDA device that kernel choices ask on every call (compute capability, opt-in
shared memory), read from the driver once per device: the query costs microseconds, and
every MoE / MLP layer of a step asks."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA ``device``."""
    p = _properties(_index(device))
    return p.major, p.minor


def shared_memory_optin(device: torch.device) -> int:
    """Opt-in shared memory per block, in bytes, of CUDA ``device``."""
    return _properties(_index(device)).shared_memory_per_block_optin
