"""A CPU KV pool from the operating system's zero pages.

``torch.zeros`` on the CPU writes every byte: ~0.6 s a gigabyte on a 2-core VM, and the whole
pool resident from the start (the CPU default is ~1 GB, for every engine process a test or a
server starts). numpy's zeros come from ``calloc``, whose large blocks are fresh anonymous
mappings that the kernel fills with zeros on first touch: the pool costs nothing until blocks
are written. Not for a suspendable pool: the emulated suspend backend resizes the storage in
place (``memory_suspend.EmulatedBackend``), which memory numpy owns does not allow."""
from __future__ import annotations

import math

import numpy as np
import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, suspendable: bool) -> torch.Tensor:
    """``torch.zeros(shape, dtype, device)``, from zero pages on the CPU unless ``suspendable``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or suspendable or not nbytes:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
