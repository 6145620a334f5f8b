"""What a request's computed prompt is, as bytes: its KV blocks of every attention layer, then
(hybrid models) its Mamba conv and SSM state of every Mamba layer. Both engines run one model
setup (the coordinator checks the block size; the same model gives the same shapes), so the
receiver knows the layout from the block count.

A transfer moves the blocks in chunks of whole blocks (``chunks``): each chunk is every layer's
``[2, n, block, heads, head_dim]`` slice of those blocks, in layer order, gathered into one
buffer (``pack_into``) and scattered from it (``scatter``): on CUDA one Triton launch each
(kernels/triton_kv_chunk.py, the layers' addresses in a device table built once), elsewhere one
index_select / index_copy_ per layer, the reference the kernel's bytes are tested against. The
Mamba state travels last, in a buffer of its own (``state_bytes``). Without chunking (one chunk
of every block, then the state) the bytes are ``pack``'s: what an "ipc" pair shares.

    layout = KVLayout(context)
    state = layout.take_state(req.state_slot)        # prefill side, before the slot is freed
    buf = layout.pack(block_ids, state)              # prefill side, one buffer
    layout.unpack(buf, new_block_ids, req.state_slot)  # decode side, into its own pool"""
from __future__ import annotations

import time

import torch

from megatron_async.kernels.fused_ops import triton_importable
from megatron_async.kernels.kv_cache_fp8 import byte_view


class KVLayout:
    def __init__(self, context, one_launch: bool | None = None):
        """``one_launch``: move chunks with the Triton kernel (None: on CUDA, where triton imports)."""
        self.kv = [byte_view(t) for t in context.kv_caches]  # each [2, num_blocks, block_size, heads, head_dim]
        mamba = context.mamba
        self.states = [] if mamba is None else list(mamba.conv_states) + list(mamba.ssm_states)  # each [slots + 1, ...]
        self.device = self.kv[0].device if self.kv else (self.states[0].device if self.states else torch.device("cpu"))
        self.one_launch = self.device.type == "cuda" and triton_importable() if one_launch is None else one_launch
        self._table = None

    def block_bytes(self) -> int:
        """Bytes of one block over every layer."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.kv)

    def state_bytes(self) -> int:
        """Bytes of one request's Mamba state (0 without Mamba layers)."""
        return sum(t[0].numel() * t.element_size() for t in self.states)

    def nbytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_bytes() + self.state_bytes()

    def chunks(self, num_blocks: int, chunk_bytes: int) -> list[tuple[int, int]]:
        """(first, count) block ranges of at most ``chunk_bytes`` each (at least one block each)."""
        per = max(1, chunk_bytes // max(1, self.block_bytes()))
        return [(i, min(per, num_blocks - i)) for i in range(0, num_blocks, per)]

    def take_state(self, slot: int) -> list[torch.Tensor] | None:
        """A copy of a request's Mamba states (stream-ordered after the launches that wrote them),
        before its slot goes back; None without Mamba layers."""
        if not self.states or slot < 0:
            return None
        return [t[slot].clone() for t in self.states]

    def _views(self, buf: torch.Tensor, n: int):
        """(layer, its ``[2, n, ...]`` view of ``buf``) for every layer, in order."""
        offset = 0
        for t in self.kv:
            size = t[:, 0].numel() * n * t.element_size()
            yield t, buf[offset:offset + size].view(t.dtype).view(t.shape[0], n, *t.shape[2:])
            offset += size

    def _pool_table(self, buf: torch.Tensor):
        """The one-launch kernel's table (None: the per-layer torch ops move this chunk)."""
        if not self.one_launch or not self.kv or not buf.is_contiguous():
            return None
        if self._table is None or not self._table.current():  # (built once: the pools keep their addresses)
            from megatron_async.kernels import triton_kv_chunk
            if not triton_kv_chunk.qualifies(self.kv):
                return None
            self._table = triton_kv_chunk.PoolTable(self.kv)
        return self._table

    def pack_into(self, out: torch.Tensor, idx: torch.Tensor) -> None:
        """Gather blocks ``idx`` (an int64 tensor on the pool's device) of every layer into ``out``
        (uint8, ``len(idx) * block_bytes()`` long, on the pool's device)."""
        if (table := self._pool_table(out)) is not None:
            return table.move(out, idx, gather=True)
        for t, view in self._views(out, idx.numel()):
            torch.index_select(t, 1, idx, out=view)

    def scatter(self, buf: torch.Tensor, idx: torch.Tensor) -> None:
        """``pack_into``'s bytes into blocks ``idx`` of this pool."""
        if (table := self._pool_table(buf)) is not None:
            return table.move(buf, idx, gather=False)
        for t, view in self._views(buf, idx.numel()):
            t.index_copy_(1, idx, view)

    def warm_up(self) -> float:
        """Move a few chunks of block 0 out and back, its bytes unchanged, at the engine's start:
        what a transfer's first chunks would otherwise do on a connection's thread while the
        engine serves (compile and load every variant of the one-launch kernel: chunks of 1, of
        a multiple of 16 and of other block counts, their ids at any 8-byte offset; build its
        table; the device loading the torch ops' kernels), where a module load waits for the
        device's running kernels and holds the loop's launches meanwhile. Returns its seconds."""
        start = time.perf_counter()
        for n in (1, 2, 16) if self.kv else ():
            for offset in (0, 1):
                idx = torch.zeros(n + offset, dtype=torch.int64, device=self.device)[offset:]
                buf = torch.empty(n * self.block_bytes(), dtype=torch.uint8, device=self.device)
                self.pack_into(buf, idx)
                self.scatter(buf, idx)  # (the same bytes back: every id is block 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def pack_state(self, out: torch.Tensor, state: list[torch.Tensor] | None) -> None:
        offset = 0
        for t, s in zip(self.states, state or ()):
            n = s.numel() * s.element_size()
            out[offset:offset + n].view(s.dtype).view(s.shape).copy_(s)
            offset += n

    def unpack_state(self, buf: torch.Tensor | None, slot: int) -> None:
        """``pack_state``'s bytes into state slot ``slot``."""
        offset = 0
        for t in self.states if buf is not None else ():
            n = t[0].numel() * t.element_size()
            t[slot].copy_(buf[offset:offset + n].view(t.dtype).view(t.shape[1:]))
            offset += n

    def copy_chunk(self, packed: torch.Tensor, num_blocks: int, first: int, n: int, out: torch.Tensor) -> None:
        """Blocks ``first:first + n`` of ``packed`` (``pack``'s bytes of ``num_blocks`` blocks: each
        layer's slice of every block, layer after layer; on any device) into ``out`` as a chunk
        (``pack_into``'s layout of those ``n`` blocks, which ``scatter`` takes)."""
        for (_, whole), (_, part) in zip(self._views(packed, num_blocks), self._views(out, n)):
            part.copy_(whole[:, first:first + n], non_blocking=True)

    def pack(self, block_ids: list[int], state: list[torch.Tensor] | None) -> torch.Tensor:
        out = torch.empty(self.nbytes(len(block_ids)), dtype=torch.uint8, device=self.device)
        split = len(block_ids) * self.block_bytes()
        self.pack_into(out[:split], torch.tensor(block_ids, dtype=torch.int64, device=self.device))
        self.pack_state(out[split:], state)
        return out

    def empty(self, num_blocks: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A buffer of ``num_blocks`` blocks (and a state)."""
        return torch.empty(self.nbytes(num_blocks), dtype=torch.uint8, device=device or self.device)

    def put_state(self, state: list[torch.Tensor] | None, slot: int) -> None:
        """``take_state``'s copy into state slot ``slot``."""
        for t, s in zip(self.states, state or ()):
            t[slot].copy_(s)

    def unpack(self, buf: torch.Tensor, block_ids: list[int], slot: int) -> None:
        """Copy ``buf`` (``pack``'s bytes) into ``block_ids`` of this pool and state slot ``slot``."""
        self.check(buf.numel(), len(block_ids))
        buf = buf.to(self.device)
        split = len(block_ids) * self.block_bytes()
        self.scatter(buf[:split], torch.tensor(block_ids, dtype=torch.int64, device=self.device))
        self.unpack_state(buf[split:], slot)

    def check(self, nbytes: int, num_blocks: int) -> None:
        if nbytes != self.nbytes(num_blocks):
            raise ValueError(f"a transfer of {nbytes} bytes for {num_blocks} blocks "
                             f"({self.nbytes(num_blocks)} expected): another model setup?")
