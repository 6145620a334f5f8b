"""Paged KV block pool: free list, ref counts, chained prefix hashes, LRU reclaim.

Block 0 is a dummy that padding rows and unused block-table entries point at; it is
never handed out. A block with ref count 0 whose hash is registered stays cached
(reusable by a later request with the same prefix) until it is reclaimed LRU.

Block identity is a chained SHA-256 (parent digest + token ids + a key naming the model
or adapter), not Python's 64-bit ``hash``: a crafted collision there would hand one
request another's KV. The key object also keeps the hashed bytes and compares them, so
even a digest collision at one level cannot alias two different blocks."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

DUMMY_BLOCK = 0


def _digest(message: bytes) -> bytes:
    return hashlib.sha256(message).digest()


class BlockKey:
    """Identity of a complete block: ``digest`` chains the prefix, ``content`` (parent digest +
    token bytes) is compared on equality."""

    __slots__ = ("digest", "content", "_hash")

    def __init__(self, digest: bytes, content: bytes):
        self.digest, self.content = digest, content
        self._hash = hash(digest)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockKey) and self.digest == other.digest and self.content == other.content

    def __repr__(self) -> str:
        return f"BlockKey({self.digest[:6].hex()}...)"


def chain_hash(parent: BlockKey | None, tokens: Sequence[int], key: bytes = b"") -> BlockKey:
    """Identity of a complete block given its parent block's (None for the first block);
    ``key`` separates models / adapters that must never share KV."""
    head = parent.digest if parent is not None else _digest(b"megatron_async.kv\0" + key)
    content = head + array("q", tokens).tobytes()
    return BlockKey(_digest(content), content)


class KVBlockAllocator:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool, hash_key: bytes = b""):
        """``hash_key``: names the model / adapter whose KV these blocks hold (part of every
        block identity, so differently keyed pools never match each other's prefixes)."""
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (block 0 is the dummy)")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, DUMMY_BLOCK, -1))  # pop() gives 1, 2, ...
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, BlockKey] = {}  # block -> hash
        self._block_of: dict[BlockKey, int] = {}  # hash -> block
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref 0, oldest first
        self.on_reclaim = None  # callback(block_id, block_hash) when a cached block loses its hash
        self.hash_key = hash_key

    def block_hash(self, parent: BlockKey | None, tokens: Sequence[int]) -> BlockKey:
        return chain_hash(parent, tokens, self.hash_key)

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

    def register(self, block: int, block_hash: BlockKey) -> None:
        """Make a complete, computed block findable by its prefix hash."""
        if not self.enable_prefix_caching or block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def lookup(self, block_hash: BlockKey) -> int | None:
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
