"""Where a step's grammar token masks travel: host buffers the engine fills (pinned, a ring of
three like the sample buffers, so a buffer is refilled only after the copy out of it has run),
and the fixed device buffers the sampling of the step reads. Allocated on the first step that
needs them: an engine that never sees a grammar pays no memory."""
from __future__ import annotations

import torch

from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.structured.request_grammar import bitmask_words


class TokenMaskBuffers:
    def __init__(self, max_samples: int, vocab_size: int, device: DeviceFacade):
        self.max_samples, self.words = max_samples, bitmask_words(vocab_size)
        self.device = device
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ring = 0
        self.bitmask: torch.Tensor | None = None
        """Device int32 [max_samples, W]: one row per constrained sample of the step."""
        self.row_map: torch.Tensor | None = None
        """Device int32 [max_samples]: a sample's bitmask row, -1 for a sample without a grammar."""

    @torch.inference_mode(False)  # plain tensors: the grammar worker thread (not in inference mode) writes them
    def _allocate(self) -> None:
        pin, S, W = self.device.is_cuda, self.max_samples, self.words
        self._host = [(torch.zeros(S, W, dtype=torch.int32, pin_memory=pin), torch.zeros(S, dtype=torch.int32, pin_memory=pin))
                      for _ in range(3)]
        self.bitmask = torch.zeros(S, W, dtype=torch.int32, device=self.device.device)
        self.row_map = torch.full((S,), -1, dtype=torch.int32, device=self.device.device)

    def host(self, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next host buffers: the bitmask and the row map of ``num_samples`` samples, all -1."""
        if not self._host:
            self._allocate()
        self._ring = (self._ring + 1) % len(self._host)
        bitmask, row_map = self._host[self._ring]
        row_map[:num_samples] = -1
        return bitmask, row_map[:num_samples]

    def to_device(self, num_rows: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Enqueue the copy of the current host buffers' first ``num_rows`` bitmask rows and
        ``num_samples`` row-map entries; returns the device views the sampling reads."""
        bitmask, row_map = self._host[self._ring]
        self.bitmask[:num_rows].copy_(bitmask[:num_rows], non_blocking=True)
        self.row_map[:num_samples].copy_(row_map[:num_samples], non_blocking=True)
        return self.bitmask[:max(num_rows, 1)], self.row_map[:num_samples]
