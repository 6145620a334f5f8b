"""Field specs -> one byte layout shared by the CPU bookkeeping buffer and its GPU view.

The layout is declared once (a list of ``FieldSpec``); both the host buffer and the
device buffer are cut into typed views from that one declaration, so the two sides
can never disagree and the whole snapshot moves in one copy."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 16  # bytes; keeps every view aligned for vectorised loads


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


class BookkeepingLayout:
    def __init__(self, fields: list[FieldSpec]):
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate bookkeeping field names in {names}")
        self.fields = fields
        self.offsets: dict[str, int] = {}
        off = 0
        for f in fields:
            self.offsets[f.name] = off
            off += (f.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.nbytes = off

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of every field into a uint8 buffer of ``nbytes`` (host or device)."""
        if buffer.dtype != torch.uint8 or buffer.numel() < self.nbytes:
            raise ValueError("bookkeeping buffer must be uint8 with at least layout.nbytes elements")
        out = {}
        for f in self.fields:
            o = self.offsets[f.name]
            out[f.name] = buffer[o : o + f.nbytes].view(f.dtype).view(f.shape)
        return out
