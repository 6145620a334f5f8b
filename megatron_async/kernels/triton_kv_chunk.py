"""A chunk of KV blocks of every layer gathered into one staging buffer, or scattered back, in one
launch (``disaggregation/kv_layout.py`` keeps the torch reference: one index_select / index_copy_
per layer, 36 launches of ~1.8 MB each per chunk on Qwen3-8B).

The bytes are ``KVLayout.pack_into``'s: layer after layer, each layer's ``[2, n, block, heads,
head_dim]`` slice of the chunk's ``n`` blocks. Layers may differ in shape and element type
(head counts of a hybrid or MTP pool, an e4m3 pool): the kernel moves bytes, reading each layer's
base address and geometry from a device table built once (``PoolTable``; the pools never move:
suspend keeps their addresses). One program copies one tile of one layer's half-block row
(``block * heads * head_dim`` elements); where every address and row is a multiple of 16 bytes it
moves int32 lanes with 16-byte alignment hints (vector loads and stores), else single bytes."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FIELDS = 4
"""Per layer: base address, bytes of one block's half row, blocks in the pool, bytes of the
earlier layers' parts of one block (so a chunk of n blocks puts this layer at n times that)."""
TILE_BYTES = 8192
"""Bytes one program moves (128 threads, four 16-byte vectors each)."""


@triton.jit
def _chunk_kernel(buf, table, idx, n, tiles, GATHER: tl.constexpr, ELEM: tl.constexpr, ELEM_BYTES: tl.constexpr,
                  ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # (half, block of the chunk, tile of its row)
    entry = table + tl.program_id(1).to(tl.int64) * 4
    pool = tl.load(entry).to(tl.pointer_type(ELEM))
    row = tl.load(entry + 1) // ELEM_BYTES
    blocks = tl.load(entry + 2)
    before = tl.load(entry + 3) // ELEM_BYTES
    tile = pid % tiles
    r = pid // tiles
    half = r // n
    j = r - half * n
    block = tl.load(idx + j)
    pool_row = pool + (half * blocks + block) * row
    buf_row = buf + before * n + (half * n + j) * row
    if ALIGNED:  # every address and row a multiple of 16 bytes
        row = tl.multiple_of(row, 16 // ELEM_BYTES)
        pool_row = tl.multiple_of(pool_row, 16)
        buf_row = tl.multiple_of(buf_row, 16)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row
    if GATHER:
        tl.store(buf_row + offs, tl.load(pool_row + offs, mask=mask), mask=mask)
    else:
        tl.store(pool_row + offs, tl.load(buf_row + offs, mask=mask), mask=mask)


def qualifies(pools: list[torch.Tensor]) -> bool:
    """Whether ``PoolTable`` can take these pools: contiguous, all on one device."""
    return bool(pools) and all(t.is_contiguous() and t.device == pools[0].device for t in pools)


class PoolTable:
    """The pools' addresses and geometry as an int64 table on their device (``FIELDS`` per layer)."""

    def __init__(self, pools: list[torch.Tensor]):
        if not qualifies(pools):
            raise ValueError("kv chunk kernel: the pools must be contiguous and on one device")
        self.pools = pools
        self.device = pools[0].device
        self.addresses = tuple(t.data_ptr() for t in pools)
        rows = [t[0, 0].numel() * t.element_size() for t in pools]  # one block's half, in bytes
        self.block_bytes = 2 * sum(rows)
        self.max_row = max(rows)
        entries, before = [], 0
        for t, row, address in zip(pools, rows, self.addresses):
            entries.append([address, row, t.shape[1], before])
            before += 2 * row
        self.aligned = all(a % 16 == 0 and row % 16 == 0 for a, row in zip(self.addresses, rows))
        self.table = torch.tensor(entries, dtype=torch.int64).to(self.device)
        if self.device.type == "cuda":  # (read by other streams' launches from now on)
            torch.cuda.current_stream(self.device).synchronize()

    def current(self) -> bool:
        """Whether the pools still sit at the addresses the table holds."""
        return tuple(t.data_ptr() for t in self.pools) == self.addresses

    def move(self, buf: torch.Tensor, idx: torch.Tensor, gather: bool) -> None:
        """Gather blocks ``idx`` of every layer into ``buf`` (``gather``), or scatter ``buf`` into them."""
        n = idx.numel()
        if buf.dtype != torch.uint8 or not buf.is_contiguous() or buf.numel() != n * self.block_bytes:
            raise ValueError(f"kv chunk kernel: a buffer of {n * self.block_bytes} contiguous bytes expected")
        if idx.dtype != torch.int64 or buf.device != self.device or idx.device != self.device:
            raise ValueError("kv chunk kernel: int64 block ids, buffer and ids on the pools' device")
        if n == 0:
            return
        aligned = self.aligned and buf.data_ptr() % 16 == 0
        elem_bytes = 4 if aligned else 1
        block = TILE_BYTES // elem_bytes
        tiles = triton.cdiv(self.max_row // elem_bytes, block)
        _chunk_kernel[(2 * n * tiles, len(self.pools))](
            buf.view(torch.int32) if aligned else buf, self.table, idx.contiguous(), n, tiles, GATHER=gather,
            ELEM=tl.int32 if aligned else tl.uint8, ELEM_BYTES=elem_bytes, ALIGNED=aligned, BLOCK=block, num_warps=4)
