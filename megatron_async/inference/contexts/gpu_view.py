"""ContextGPUView: the device-side mirror of the CPU bookkeeping, filled by ONE copy per step."""
from __future__ import annotations

import torch

from megatron_async.inference.contexts.bookkeeping_layout import BookkeepingLayout


class ContextGPUView:
    """Fixed-address device views (CUDA-graph safe) of every bookkeeping field.

    Attribute access (``view.positions``) returns the device view of that field."""

    def __init__(self, layout: BookkeepingLayout, device: torch.device):
        self._layout = layout
        self.buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        self._views = layout.views(self.buffer)
        self.num_copies = 0  # H2D copies issued (tests assert one per step)

    def __getattr__(self, name: str) -> torch.Tensor:
        views = self.__dict__.get("_views")
        if views is not None and name in views:
            return views[name]
        raise AttributeError(name)

    def copy_from(self, host_buffer: torch.Tensor) -> None:
        """The step's single H2D transfer (non-blocking from pinned memory on CUDA)."""
        self.buffer.copy_(host_buffer, non_blocking=True)
        self.num_copies += 1
