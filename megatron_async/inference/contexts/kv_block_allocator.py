"""Paged KV block pool: free list, ref counts, chained prefix hashes, LRU reclaim.

Block 0 is a dummy that padding rows and unused block-table entries point at; it is
never handed out. A block with ref count 0 whose hash is registered stays cached
(reusable by a later request with the same prefix) until it is reclaimed LRU.

Block identity is a chained SHA-256 (parent digest + token ids + a key naming the model
or adapter), not Python's 64-bit ``hash``: a crafted collision there would hand one
request another's KV. The key object also keeps the hashed bytes and compares them, so
even a digest collision at one level cannot alias two different blocks."""
from __future__ import annotations

import functools
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

DUMMY_BLOCK = 0


DIGEST_BYTES = 32
"""A block digest's length (SHA-256)."""


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


@functools.lru_cache(maxsize=256)
def root_digest(key: bytes) -> bytes:
    """The digest a first block chains from: ``key`` separates models / adapters (and weight
    versions) that must never share KV. (Cached: every prompt hashed starts from it.)"""
    return _digest(b"megatron_async.kv\0" + key)


def chain_hash(parent: BlockKey | None, tokens: Sequence[int], key: bytes = b"", digest: bytes | None = None
               ) -> BlockKey:
    """Identity of a complete block given its parent block's (None for the first block);
    ``key`` separates models / adapters that must never share KV. ``digest``: the block's
    digest where it is known (``known_digests``): not computed again."""
    head = parent.digest if parent is not None else root_digest(key)
    content = head + array("q", tokens).tobytes()
    return BlockKey(_digest(content) if digest is None else digest, content)


def chain_keys(parent: BlockKey | None, tokens: Sequence[int], block_size: int, key: bytes,
               known: tuple[bytes, list[bytes]] | None = None, first: int = 0) -> list[BlockKey]:
    """``chain_hash`` of each whole block of ``tokens`` in turn, the first chained from ``parent``,
    in one pass (one byte conversion); block ``first + j``'s digest is read from ``known`` (a
    request's adopted ``prompt_digests``, ``adopted_digest``) where it is there, else hashed."""
    raw = memoryview(array("q", tokens).tobytes())
    step = 8 * block_size
    head = parent.digest if parent is not None else root_digest(key)
    digests = known[1] if known is not None and known[0] is key else ()
    out = []
    for i, start in enumerate(range(0, len(raw) - step + 1, step), first):
        content = head + raw[start:start + step]
        head = digests[i] if i < len(digests) else _digest(content)
        out.append(BlockKey(head, content))
    return out


def prefix_digests(tokens: Sequence[int], block_size: int, key: bytes, num_blocks: int | None = None) -> list[bytes]:
    """``chain_hash``'s digests of the first ``num_blocks`` whole blocks of ``tokens`` (None: the
    blocks a request with this prompt can hit, ``(len(tokens) - 1) // block_size``: its last
    token is always computed), in one pass: one byte conversion, one SHA-256 per block, no key
    objects. The data-parallel coordinator routes on them (the same bytes ``chain_hash`` gives)."""
    n = (len(tokens) - 1) // block_size if num_blocks is None else num_blocks
    if n <= 0:
        return []
    raw = memoryview(array("q", tokens[:n * block_size]).tobytes())
    step, head, out = 8 * block_size, root_digest(key), []
    for start in range(0, n * step, step):
        head = _digest(head + raw[start:start + step])
        out.append(head)
    return out


def known_digests(packed: bytes, tokens: Sequence[int], block_size: int, key: bytes) -> list[bytes] | None:
    """``prefix_digests`` of ``tokens`` as another rank computed them (``packed``: 32 bytes each,
    ``tokens``' leading blocks), or None where they were computed with another key (other weights)
    or do not fit ``tokens``: the first block is hashed here to tell (one SHA-256, not one a block)."""
    n = len(packed) // DIGEST_BYTES
    if not n or len(packed) % DIGEST_BYTES or n * block_size > len(tokens):
        return None
    out = [packed[i:i + DIGEST_BYTES] for i in range(0, len(packed), DIGEST_BYTES)]
    return out if prefix_digests(tokens, block_size, key, 1)[0] == out[0] else None


def adopted_digest(known: tuple[bytes, list[bytes]] | None, key: bytes, i: int) -> bytes | None:
    """Block ``i``'s digest from a request's adopted digests (``(key, digests)``: its
    ``prompt_digests``), where they were computed with ``key`` and reach block ``i``; else None."""
    return known[1][i] if known is not None and known[0] is key and i < len(known[1]) else None


class KVBlockAllocator:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool, hash_key: bytes = b"", share_live: bool = False):
        """``hash_key``: names the model / adapter whose KV these blocks hold (part of every
        block identity, so differently keyed pools never match each other's prefixes);
        ``share_live``: without prefix caching, complete blocks are still findable while a
        request holds them (prompts shared by requests running at once), and freed, hash
        dropped, when the last holder lets go."""
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (block 0 is the dummy)")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.publishes = enable_prefix_caching or share_live
        """Complete blocks are registered and looked up (cached beyond their holders only with
        prefix caching)."""
        self._free: list[int] = list(range(num_blocks - 1, DUMMY_BLOCK, -1))  # pop() gives 1, 2, ...
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, BlockKey] = {}  # block -> hash
        self._block_of: dict[BlockKey, int] = {}  # hash -> block
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref 0, oldest first
        self.on_reclaim = None  # callback(block_id, block_hash) when a cached block loses its hash
        self.hash_key = hash_key
        self.eviction_sinks: list[list[bytes]] = []
        """One list per reader (``record_evictions``) of the digests of the cached blocks reclaimed
        since that reader last emptied it: data-parallel routers (rank 0's, a coordinator's
        through the engine link) learn what an engine no longer holds."""

    def record_evictions(self) -> list[bytes]:
        """A new reader's list of reclaimed blocks' digests: from now on every reclaim is appended
        to it (the reader empties it as it reads)."""
        sink: list[bytes] = []
        self.eviction_sinks.append(sink)
        return sink

    def block_hash(self, parent: BlockKey | None, tokens: Sequence[int], digest: bytes | None = None) -> BlockKey:
        return chain_hash(parent, tokens, self.hash_key, digest)

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
                if b in self._hash_of and self.enable_prefix_caching:
                    self._lru[b] = None
                else:
                    if b in self._hash_of:  # shared while held only
                        self._drop_hash(b)
                    self._free.append(b)

    def register(self, block: int, block_hash: BlockKey) -> None:
        """Make a complete, computed block findable by its prefix hash (a block already hashed, or a
        hash already cached in another block, stays as it is)."""
        self.register_run((block,), (block_hash,))

    def register_run(self, blocks: Sequence[int], keys: Sequence[BlockKey]) -> None:
        """``register`` for each (block, key) pair in turn (a request's newly complete blocks)."""
        if not self.publishes:
            return
        hash_of, block_of = self._hash_of, self._block_of
        for block, key in zip(blocks, keys):
            if block not in hash_of and key not in block_of:
                hash_of[block] = key
                block_of[key] = block

    def lookup(self, block_hash: BlockKey) -> int | None:
        return self._block_of.get(block_hash) if self.publishes else None

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
            for sink in self.eviction_sinks:
                sink.append(h.digest)
            if self.on_reclaim is not None:
                self.on_reclaim(block, h)
