"""Paged KV block pool: free list, ref counts, chained prefix hashes, LRU reclaim.

Block 0 is a dummy that padding rows and unused block-table entries point at; it is
never handed out. A block with ref count 0 whose hash is registered stays cached
(reusable by a later request with the same prefix) until it is reclaimed LRU."""
from __future__ import annotations

from collections import OrderedDict

DUMMY_BLOCK = 0


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a complete block given its parent block's hash (None for the first block)."""
    return hash((parent, tokens))


class KVBlockAllocator:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool):
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (block 0 is the dummy)")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, DUMMY_BLOCK, -1))  # pop() gives 1, 2, ...
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> hash
        self._block_of: dict[int, int] = {}  # hash -> block
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref 0, oldest first
        self.on_reclaim = None  # callback(block_id, block_hash) when a cached block loses its hash

    @property
    def capacity(self) -> int:
        """Blocks that can ever be handed out."""
        return self.num_blocks - 1

    @property
    def num_available(self) -> int:
        """Blocks obtainable now: free plus reclaimable cached ones."""
        return len(self._free) + len(self._lru)

    def allocate(self) -> int | None:
        """One block with ref count 1, or None when the pool is exhausted."""
        if self._free:
            block = self._free.pop()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            self._drop_hash(block)
        else:
            return None
        self._ref[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._ref[b] -= 1
            assert self._ref[b] >= 0, f"block {b} released more often than held"
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def register(self, block: int, block_hash: int) -> None:
        """Make a complete, computed block findable by its prefix hash."""
        if not self.enable_prefix_caching or block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def lookup(self, block_hash: int) -> int | None:
        return self._block_of.get(block_hash) if self.enable_prefix_caching else None

    def acquire_cached(self, block: int) -> None:
        """Take a reference on a cached block found by ``lookup``."""
        if self._ref[block] == 0:
            self._lru.pop(block, None)
        self._ref[block] += 1

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def _drop_hash(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            if self.on_reclaim is not None:
                self.on_reclaim(block, h)
