"""Rank 0's routing of new requests to the data-parallel ranks of one job (``expert_parallel_size``
> 1; under TP x EP the unit is the data-parallel rank), by ``InferenceConfig.dp_routing`` with the
coordinator's pure functions (inference/dp_routing.py).

Load of a rank: its unfinished requests as the latest exchange carried them (``Agreement.loads``)
plus the requests routed to it since.

Prefix view (the affinity policies, with prefix caching on): rank 0 hashes each prompt once, at
``add_request`` (``prefix_digests``, with its own cache's key: every rank's is the same, one model
whose weights change at the same step everywhere), assigns the keys to the rank it routes to with
that rank's submission number, and removes the keys a rank reports evicted: rank 0's from its own
allocator, the others' from their uploads (``Upload.evicted``: 8 bytes a key, with the count of
submissions that rank had received; a key routed there again after the eviction stays). New
weights re-key every cache: the view is forgotten. The digests travel with the request
(``NewRequest.digests``), so the serving rank's admission does not hash the prompt again."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_async.config.modes import DpRouting
from megatron_async.inference.contexts.kv_block_allocator import KVBlockAllocator, known_digests, prefix_digests
from megatron_async.inference.dp_routing import PrefixView, choose, keys_from_bytes, keys_of, packed_keys


@dataclass(eq=False)
class RankSlot:
    """What routing reads of one data-parallel rank (``dp_routing.EngineSlot``)."""

    index: int
    max_requests: int
    pending: int = 0
    affinity: bool = False


def routes_by_prefix(policy: DpRouting, allocator: KVBlockAllocator) -> bool:
    """Whether ``policy`` reads the ranks' caches: a prefix policy, with prefix caching on."""
    return DpRouting(policy) is not DpRouting.LOAD_BALANCED and allocator.enable_prefix_caching


def take_evicted(evicted: list[bytes] | None) -> bytes:
    """The routing keys of the digests in ``evicted`` (an allocator's ``record_evictions`` list,
    or None: not recorded), 8 bytes each; the list is emptied."""
    if not evicted:
        return b""
    packed = packed_keys(evicted)
    evicted.clear()
    return packed


class RankRouter:
    def __init__(self, policy: DpRouting, alpha: float, dp_size: int, max_requests: int,
                 allocator: KVBlockAllocator, block_size: int):
        """``allocator``: rank 0's (its key, capacity and prefix caching stand for every rank's)."""
        self.policy, self.alpha = DpRouting(policy), float(alpha)
        self.by_prefix = routes_by_prefix(self.policy, allocator)
        self.slots = [RankSlot(r, max_requests, affinity=self.by_prefix) for r in range(dp_size)]
        self.view = PrefixView()
        for r in range(dp_size):
            self.view.add_engine(r, allocator.capacity)
        self._alloc, self._block_size, self._key = allocator, block_size, allocator.hash_key
        self._own_evictions = allocator.record_evictions() if self.by_prefix else None
        self._loads: Sequence[int] = (0,) * dp_size
        self._since = [0] * dp_size  # routed after the latest exchange
        self.submitted = [0] * dp_size
        """Requests routed to each rank so far (the submission number of its latest)."""
        self.evicted_keys = 0
        """Keys the ranks reported evicted (rank 0's own included)."""

    def digests(self, prompt: Sequence[int], known: bytes = b"") -> list[bytes]:
        """The prompt's block digests where routing reads them (else []): its one hashing, or
        ``known`` (as a coordinator's client computed them) where they are this cache's key's."""
        if not self.by_prefix:
            return []
        key = self._alloc.hash_key
        if key is not self._key:  # new weights: every rank's cache was re-keyed
            self._key = key
            for slot in self.slots:
                self.view.reset_engine(slot.index)
        return (known_digests(known, prompt, self._block_size, key) if known else None) or \
            prefix_digests(prompt, self._block_size, key)

    def route(self, digests: Sequence[bytes]) -> int:
        """The data-parallel rank of a new request with these prompt digests (ties: lowest rank)."""
        for s in self.slots:
            s.pending = self._loads[s.index] + self._since[s.index]
        keys = keys_of(digests) if digests else []
        rank = choose(self.policy, keys, self.slots, self.view, self.alpha).index
        self._since[rank] += 1
        self.submitted[rank] += 1
        if keys:
            self.view.assign(rank, keys, self.submitted[rank])
        return rank

    def heard(self, loads: Sequence[int]) -> None:
        """An exchange carried ``loads`` (by rank) and every request routed before it."""
        if loads:
            self._loads = loads
        self._since = [0] * len(self.slots)

    def evicted(self, rank: int, packed: bytes, received: int) -> None:
        """``rank`` reclaimed the blocks of these keys (``take_evicted``) having received
        ``received`` of the requests routed to it."""
        if packed and 0 <= rank < len(self.slots):
            keys = keys_from_bytes(packed)
            self.evicted_keys += len(keys)
            self.view.evict(rank, keys, received)

    def take_own_evictions(self, received: int) -> None:
        """Rank 0's own cache's reclaimed blocks (it is data-parallel rank 0)."""
        self.evicted(0, take_evicted(self._own_evictions), received)
