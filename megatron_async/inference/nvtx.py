"""NVTX ranges around engine stages, gated by one flag (off = a shared no-op context)."""
from __future__ import annotations

import contextlib

import torch

_enabled = False
_NULL = contextlib.nullcontext()


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on) and torch.cuda.is_available()


@contextlib.contextmanager
def _nvtx(name: str):
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def nvtx_range(name: str):
    """``with nvtx_range("forward_pass"): ...`` — free when ranges are off."""
    return _nvtx(name) if _enabled else _NULL
