"""Which data-parallel engine a new request goes to: pure functions over plain records
(``InferenceConfig.dp_routing``). One definition for both routers: the coordinator's (engines in
processes of their own, coordinator/core.py) and rank 0's inside one job of data-parallel ranks
(``expert_parallel_size``, engines/rank_router.py). Neither imports torch through this module.

Keys are the prefix cache's own chained block digests (``kv_block_allocator.prefix_digests``,
rooted in the engines' ``hash_key``), the first 8 bytes of each as a signed little-endian int:
a collision costs one misrouted request, never wrong KV (an engine compares whole block
contents). Only the blocks a request can hit count: its last prompt token is always computed.

The view of what each engine's cache holds (``PrefixView``) is kept from what was routed to it
(its prompt's keys, at routing) and from what it reports evicted (the keys of the blocks its
allocator reclaimed, piggybacked on its outputs). An engine's match depth is the number of
LEADING keys it holds: a block whose parent is gone cannot be hit.

Policies, over the candidates (engines that take requests; among them those with room for the
request, or all of them when none has):
- ``load_balanced``: the most free request slots, as a share of the engine's ``max_requests``
  (below 0 when more requests than slots were routed to it: queued there);
- ``first_prefix_block``: among the holders of the first key the most free, else load_balanced;
- ``longest_prefix``: among the deepest matches (depth > 0) the most free, else load_balanced;
- ``scored``: the best ``alpha * depth / len(keys) + (1 - alpha) * free share``.
Every tie goes to the lowest engine index (registration order; a data-parallel rank's index is
its ``dp_rank``): the same arrivals in the same order are routed the same way."""
from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from megatron_async.config.modes import DpRouting
from megatron_async.inference.contexts.kv_block_allocator import prefix_digests


class EngineSlot(Protocol):
    """What routing reads of an engine (coordinator/engines.py's ``EngineSlot``, rank_router.py's
    ``RankSlot``)."""

    index: int
    """Registration order: ties go to the lowest."""
    max_requests: int
    pending: int
    """Requests routed to it and not yet ended."""
    affinity: bool
    """Its cache caches prefixes in the keys being routed on."""


def keys_of(digests: Sequence[bytes]) -> list[int]:
    """The routing key of each block digest."""
    return keys_from_bytes(packed_keys(digests))


def packed_keys(digests: Sequence[bytes]) -> bytes:
    """The routing keys of ``digests`` as they travel: little-endian int64s, one per block."""
    return b"".join(d[:8] for d in digests)


def keys_from_bytes(raw: bytes) -> list[int]:
    """``packed_keys`` back (ValueError when the length is not a whole number of keys)."""
    if len(raw) % 8:
        raise ValueError("routing keys are 8 bytes each")
    return list(struct.unpack(f"<{len(raw) // 8}q", raw))


def digest_keys(packed: bytes) -> list[int]:
    """The routing keys of block digests as they travel (32 bytes each, joined)."""
    return [k for (k,) in _DIGEST_KEY.iter_unpack(packed)]


_DIGEST_KEY = struct.Struct("<q24x")  # a digest's first 8 bytes, as routing reads them


def routing_keys(tokens: Sequence[int], block_size: int, hash_key: bytes) -> list[int]:
    """The routing keys of the blocks a request with prompt ``tokens`` can hit."""
    return keys_of(prefix_digests(tokens, block_size, hash_key))


class PrefixView:
    """key -> bitmask of the engines believed to hold that block; per engine, its keys in the
    order they were last routed to it, at most its KV capacity in blocks (beyond it the oldest are
    dropped: the engine would have reclaimed them to make room)."""

    def __init__(self):
        self.holders: dict[int, int] = {}
        self._held: dict[int, OrderedDict[int, int]] = {}  # engine -> key -> sequence number of its assignment
        self._capacity: dict[int, int] = {}

    def add_engine(self, engine: int, capacity_blocks: int) -> None:
        self._held[engine] = OrderedDict()
        self._capacity[engine] = max(1, capacity_blocks)

    def num_keys(self, engine: int) -> int:
        return len(self._held.get(engine, ()))

    def assign(self, engine: int, keys: Iterable[int], seq: int) -> None:
        """``keys`` were routed to ``engine`` with the engine's submission number ``seq``."""
        held = self._held[engine]
        bit, holders = 1 << engine, self.holders
        for k in keys:
            if k in held:
                held.move_to_end(k)
            else:
                holders[k] = holders.get(k, 0) | bit
            held[k] = seq
        over = len(held) - self._capacity[engine]
        for _ in range(max(0, over)):
            self._clear(holders, held.popitem(last=False)[0], ~bit)

    def evict(self, engine: int, keys: Iterable[int], seen_seq: int) -> None:
        """``engine`` reclaimed the blocks of ``keys`` having received its submissions up to
        ``seen_seq``: a key routed to it again after that stays (it computes the block anew)."""
        held = self._held.get(engine)
        if held is None:
            return
        keep, holders = ~(1 << engine), self.holders
        for k in keys:
            seq = held.get(k)
            if seq is not None and seq <= seen_seq:
                del held[k]
                self._clear(holders, k, keep)

    def forget_engine(self, engine: int) -> None:
        """The engine left, died or changed weights: it holds nothing of this key space."""
        held = self._held.pop(engine, None)
        self._capacity.pop(engine, None)
        keep = ~(1 << engine)
        for k in held or ():
            self._clear(self.holders, k, keep)

    def reset_engine(self, engine: int) -> None:
        """The engine's cache was re-keyed (new weights): it keeps its slot, holds nothing."""
        capacity = self._capacity.get(engine)
        self.forget_engine(engine)
        if capacity is not None:
            self.add_engine(engine, capacity)

    @staticmethod
    def _clear(holders: dict[int, int], key: int, keep: int) -> None:
        mask = holders.get(key, 0) & keep
        if mask:
            holders[key] = mask
        else:
            holders.pop(key, None)

    def depths(self, keys: Sequence[int], engines: int) -> dict[int, int]:
        """Leading keys held, per engine of the bitmask ``engines`` that holds at least one."""
        out, alive, holders = {}, engines, self.holders
        for depth, k in enumerate(keys):
            now = alive & holders.get(k, 0)
            for e in _bits(alive & ~now):
                if depth:
                    out[e] = depth
            alive = now
            if not alive:
                return out
        for e in _bits(alive):
            out[e] = len(keys)
        return out


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _free(e: EngineSlot) -> float:
    """The share of its request slots that is free; below 0 when more than fill them are routed
    to it (every engine full: the least overfull one queues the next request)."""
    return 1.0 - e.pending / e.max_requests


def _most_free(cands: Sequence[EngineSlot]) -> EngineSlot:
    return min(cands, key=lambda e: (-_free(e), e.index))


def choose(policy: DpRouting, keys: Sequence[int], candidates: Sequence[EngineSlot], view: PrefixView,
           alpha: float = 0.5, n: int = 1) -> EngineSlot | None:
    """The engine for ``n`` requests of one prompt (together), or None without candidates.
    ``candidates``: engines that take requests; those with ``affinity`` False (prefix caching off,
    or a cache in another key space) are placed by load only."""
    if not candidates:
        return None
    room = [e for e in candidates if e.pending + n <= e.max_requests] or list(candidates)
    if policy is DpRouting.LOAD_BALANCED or not keys:
        return _most_free(room)
    mask = 0
    for e in room:
        if e.affinity:
            mask |= 1 << e.index
    if policy is DpRouting.FIRST_PREFIX_BLOCK:
        first = view.holders.get(keys[0], 0) & mask
        return _most_free([e for e in room if first >> e.index & 1] or room)
    depth = view.depths(keys, mask)
    if policy is DpRouting.LONGEST_PREFIX:
        best = max(depth.values(), default=0)
        return _most_free([e for e in room if depth.get(e.index, 0) == best] if best else room)
    share = alpha / len(keys)
    return min(room, key=lambda e: (-(share * depth.get(e.index, 0) + (1 - alpha) * _free(e)), e.index))


def place(policy: DpRouting, keys: Sequence[int], candidates: Sequence[EngineSlot], view: PrefixView,
          alpha: float = 0.5, n: int = 1) -> list[EngineSlot]:
    """The engine of each of ``n`` requests of one prompt (a GRPO group): all on one engine that
    has room for them, else one by one (each placed as if those before it were there). []
    without candidates."""
    one = choose(policy, keys, candidates, view, alpha, n)
    if one is None or n == 1 or one.pending + n <= one.max_requests:
        return [] if one is None else [one] * n
    out = []
    for _ in range(n):
        e = choose(policy, keys, candidates, view, alpha, 1)
        e.pending += 1  # (undone below: the caller counts what it sends)
        out.append(e)
    for e in out:
        e.pending -= 1
    return out
