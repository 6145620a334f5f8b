"""One request's blocks on a pair connection's thread (transfer.py), on that connection's own
CUDA stream: never the engine's compute stream, so an engine's steps never queue behind a
transfer. A send starts once the compute stream's ``ready`` event passed (the blocks written);
on the decode side that event (whatever an earlier step still wrote into recycled blocks) holds
back the first scatter into the pool, not the receives: the wire's first two chunks never wait
for the engine's steps in flight.

The blocks move in chunks of whole blocks (``KVLayout.chunks``) through two staging buffers of at
most ``chunk_bytes`` each (``Staging``): the prefill side gathers chunk i + 1 while chunk i is on
the wire, the decode side posts the receive of chunk i + 1 before it scatters chunk i into its
pool; a buffer is reused only after its previous operation ended (stream order on NCCL, a wait on
gloo). Per chunk: every layer's slice gathered into one buffer, one send, one receive, every
layer's slice scattered; then the Mamba state, in a buffer of its own. Both ends chunk alike:
``chunk_bytes`` is the connection's (the same module constant on both engines)."""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

from megatron_async.disaggregation.kv_layout import KVLayout

TRANSFER_PRIORITY = -1
"""CUDA stream priority of a connection's gathers, scatters and NCCL operations (lower runs first):
they queue beside a prefill engine's long GEMMs and a decode engine's steps, and a block of theirs
takes the next free SM instead of waiting for every queued block of the step's kernels."""

CHUNK_BYTES = 128 << 20
"""Bytes of one staging buffer (two per connection, and two more in host memory when a GPU engine
uses gloo): bounded memory whatever a prompt's length. Each chunk costs a fixed ~0.2 ms beside
its bytes: an 8B request's 648 MiB over NCCL between two H200s took 4.59 ms in 64 MiB chunks and
2.91 in 128 MiB ones, against 1.75 for one plain copy (``python -m benchmarks kernel-times
kv-chunks --nccl``)."""


class Staging:
    """Two buffers on the pool's device and, where the wire's device differs (gloo from a GPU),
    two in pinned host memory, kept for the connection: each made once at ``chunk_bytes`` (or a
    larger chunk's size, made then), so later transfers allocate nothing."""

    def __init__(self, pool: torch.device, wire: torch.device, chunk_bytes: int = 0):
        self.pool, self.wire, self.chunk_bytes = pool, wire, chunk_bytes
        self._local: list[torch.Tensor | None] = [None, None]
        self._wire: list[torch.Tensor | None] = [None, None]

    def reserve(self) -> None:
        """Make both buffers now (at the connection's set-up, on its thread)."""
        for i in (0, 1):
            self.get(i, self.chunk_bytes)

    def get(self, i: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer ``i``'s (pool side, wire side) views of ``size`` bytes (one tensor when the devices agree)."""
        i %= 2
        buf = self._local[i]
        if buf is None or buf.numel() < size:
            buf = self._local[i] = torch.empty(max(size, self.chunk_bytes), dtype=torch.uint8, device=self.pool)
        if self.wire == self.pool:
            return buf[:size], buf[:size]
        wire = self._wire[i]
        if wire is None or wire.numel() < size:
            wire = self._wire[i] = torch.empty(max(size, self.chunk_bytes), dtype=torch.uint8,
                                               pin_memory=self.pool.type == "cuda")
        return buf[:size], wire[:size]


class Clock:
    """Marks on the connection's stream (CUDA events, read once they passed) or the host clock."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def seconds_between(start, end) -> float:
    """``Clock.mark``s' distance (CUDA events: both must have passed)."""
    return start.elapsed_time(end) / 1e3 if hasattr(start, "elapsed_time") else end - start


def _host_visible(pool_side: torch.Tensor, wire_side: torch.Tensor) -> torch.Tensor:
    """``pool_side``'s bytes in ``wire_side`` (a GPU engine's gloo send reads host memory)."""
    if wire_side.data_ptr() == pool_side.data_ptr():
        return pool_side
    wire_side.copy_(pool_side, non_blocking=True)
    torch.cuda.current_stream(pool_side.device).synchronize()  # (this connection's stream, this thread)
    return wire_side


def send_blocks(op: Callable, staging: Staging, layout: KVLayout, block_ids: list[int], state, chunk_bytes: int,
                clock: Clock):
    """Send ``block_ids`` (and ``state``); ``op(kind, tensor)`` posts one operation and returns its
    work. Returns the (start, end) marks of the wire's time: from the first gather's end to the last send's."""
    idx = torch.tensor(block_ids, dtype=torch.int64).to(layout.device, non_blocking=True)
    works: deque = deque()
    start = None
    for i, (first, n) in enumerate(layout.chunks(len(block_ids), chunk_bytes)):
        if len(works) == 2:
            works.popleft().wait()  # (buffer i % 2's previous send ended before it is gathered into again)
        local, wire = staging.get(i, n * layout.block_bytes())
        layout.pack_into(local, idx[first:first + n])
        out = _host_visible(local, wire)
        if start is None:
            start = clock.mark()
        works.append(op("send", out))
    if layout.state_bytes():
        buf = torch.empty(layout.state_bytes(), dtype=torch.uint8, device=layout.device)
        layout.pack_state(buf, state)
        out = buf if staging.wire == staging.pool else buf.to(staging.wire)
        start = start if start is not None else clock.mark()
        works.append(op("send", out))
    for work in works:
        work.wait()
    return start, clock.mark()


def recv_blocks(op: Callable, staging: Staging, layout: KVLayout, block_ids: list[int], chunk_bytes: int,
                before_scatter: Callable[[], None] = lambda: None):
    """Receive ``send_blocks``' bytes into ``block_ids`` of this pool; the Mamba state's bytes
    (None without Mamba layers) for the admission to put into the request's slot.
    ``before_scatter`` runs once, after the first two receives were posted and before the first
    write into the pool: the wait for the pool's blocks (launches still in flight may write
    recycled blocks) holds back the scatters, not the wire."""
    idx = torch.tensor(block_ids, dtype=torch.int64).to(layout.device, non_blocking=True)
    chunks = layout.chunks(len(block_ids), chunk_bytes)
    size = layout.block_bytes()
    posted = {}

    def post(i: int) -> None:
        if i < len(chunks):
            local, wire = staging.get(i, chunks[i][1] * size)
            posted[i] = (local, wire, op("recv", wire))

    post(0)
    for i, (first, n) in enumerate(chunks):
        post(i + 1)  # (its buffer's scatter, two chunks back, is already ordered before it)
        local, wire, work = posted.pop(i)
        work.wait()
        if wire.data_ptr() != local.data_ptr():
            local.copy_(wire, non_blocking=True)
        if i == 0:
            before_scatter()
        layout.scatter(local, idx[first:first + n])
        if wire.data_ptr() != local.data_ptr():
            torch.cuda.current_stream(local.device).synchronize()  # (host buffer free for chunk i + 2)
    if not layout.state_bytes():
        return None
    wire = torch.empty(layout.state_bytes(), dtype=torch.uint8, device=staging.wire)
    op("recv", wire).wait()
    return wire.to(layout.device, non_blocking=True)
