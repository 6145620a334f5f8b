"""An "ipc" pair's imports on the decode engine: the prefill engine's shared blocks (mapped from
its memory) are copied out chunk by chunk through bounded staging buffers (kv_stream.Staging) and
scattered into this engine's pool, on a stream of their own after an event of the compute stream
(recycled blocks no longer written by a launch in flight); an import lands once its end event
passed (a query from the engine's loop), so the engine's steps never queue behind the copy. The
mapping lives until then. On the CPU the copy is done at once."""
from __future__ import annotations

import time
from collections import deque

import torch

from megatron_async.disaggregation.kv_layout import KVLayout
from megatron_async.disaggregation.kv_stream import TRANSFER_PRIORITY, Staging


class SharedImports:
    def __init__(self, layout: KVLayout, chunk_bytes: int, times):
        """``times``: the engine's ``TransferTimes`` (the copies are the ipc transfer's own time)."""
        self.layout, self.chunk_bytes, self.times = layout, chunk_bytes, times
        cuda = layout.device.type == "cuda"
        self.stream = torch.cuda.Stream(layout.device, priority=TRANSFER_PRIORITY) if cuda else None
        self.staging = Staging(layout.device, layout.device)
        self.pending: deque = deque()  # (rid, end event or None, the state's bytes, the mapping)

    def __contains__(self, rid: int) -> bool:
        return any(entry[0] == rid for entry in self.pending)

    def __len__(self) -> int:
        return len(self.pending)

    def start(self, rid: int, shared: torch.Tensor, block_ids: list[int]) -> None:
        """Copy ``shared`` (``KVLayout.pack``'s bytes) into ``block_ids`` and keep its state's bytes."""
        layout, size = self.layout, self.layout.block_bytes()
        split = len(block_ids) * size
        if self.stream is None:
            t0 = time.perf_counter()
            self._copy_blocks(shared[:split], torch.tensor(block_ids, dtype=torch.int64))
            state = shared[split:].clone()
            self.times.add(shared.numel(), time.perf_counter() - t0)
            self.pending.append((rid, None, state, None))
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(layout.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._copy_blocks(shared[:split], torch.tensor(block_ids, dtype=torch.int64).to(layout.device,
                                                                                             non_blocking=True))
            state = torch.empty(shared.numel() - split, dtype=torch.uint8, device=layout.device)
            state.copy_(shared[split:], non_blocking=True)
            end.record()
        self.times.add_events(start, end, shared.numel(), shared)
        self.pending.append((rid, end, state, shared))

    def _copy_blocks(self, packed: torch.Tensor, idx: torch.Tensor) -> None:
        """``packed`` (``KVLayout.pack``'s blocks: layer after layer, so a chunk of blocks is a slice
        of every layer's part) into blocks ``idx``, chunk by chunk through the staging buffers."""
        layout, size = self.layout, self.layout.block_bytes()
        for i, (first, n) in enumerate(layout.chunks(idx.numel(), self.chunk_bytes)):
            local, _ = self.staging.get(i, n * size)
            layout.copy_chunk(packed, idx.numel(), first, n, local)
            layout.scatter(local, idx[first:first + n])

    def landed(self) -> list[tuple[int, torch.Tensor]]:
        """(rid, its state's bytes) of the imports whose copies ended, in order."""
        out = []
        while self.pending and (self.pending[0][1] is None or self.pending[0][1].query()):
            rid, _, state, _ = self.pending.popleft()
            if state.is_cuda:  # allocated on the copy's stream, read by the compute stream's admission
                state.record_stream(torch.cuda.current_stream(state.device))
            out.append((rid, state if state.numel() else None))
        return out
