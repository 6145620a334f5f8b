"""Rank 0's router of a job of data-parallel ranks (engines/rank_router.py), without processes:
loads are the latest exchange's plus what was routed since, the prefix policies follow
what was routed and forget what a rank reports evicted (with the count of requests it had
received), ties go to the lowest rank, new weights forget the view, and nothing is hashed where
routing does not read the caches."""
from __future__ import annotations

from megatron_async.config import DpRouting
from megatron_async.inference.contexts.kv_block_allocator import KVBlockAllocator, chain_hash, prefix_digests
from megatron_async.inference.dp_routing import keys_from_bytes, packed_keys
from megatron_async.inference.engines.rank_router import RankRouter, take_evicted

P = [list(range(100, 117)), list(range(200, 217)), list(range(300, 317))]  # 4 hittable blocks of 4 each


def router(policy=DpRouting.LONGEST_PREFIX, dp_size=2, caching=True, max_requests=4) -> RankRouter:
    return RankRouter(policy, 0.5, dp_size, max_requests, KVBlockAllocator(64, caching, b"m"), 4)


def route(r: RankRouter, prompt: list[int]) -> int:
    return r.route(r.digests(prompt))


def test_loads_are_the_latest_exchanges_plus_what_was_routed_since():
    r = router(DpRouting.LOAD_BALANCED, dp_size=3)
    r.heard((5, 0, 0))
    assert [route(r, p) for p in P] == [1, 2, 1]  # ties to the lowest rank
    r.heard((5, 2, 1))
    assert [route(r, p) for p in P] == [2, 1, 2]


def test_the_holder_of_the_longest_prefix_gets_the_next_turn_and_samples_stay_together():
    r = router()
    assert route(r, P[0]) == 0 and route(r, P[1]) == 1
    assert route(r, P[1] + [9] * 8) == 1  # the next turn: its holder
    assert [route(r, P[2]) for _ in range(3)] == [0, 0, 0]  # a group of one prompt: one rank
    assert route(r, P[2]) == 1  # rank 0 is full (4 slots): the next sample goes elsewhere
    assert r.submitted == [4, 3]


def test_an_eviction_report_removes_affinity_unless_the_key_was_routed_there_again():
    r = router(max_requests=8)
    r.heard((3, 0))
    assert route(r, P[0]) == 1  # by load
    r.heard((0, 3))
    assert route(r, P[0]) == 1  # affinity, though rank 1 is busier
    keys = packed_keys(prefix_digests(P[0], 4, b"m"))
    r.evicted(1, keys, received=1)  # rank 1 had received only the first: the second brings the blocks again
    assert route(r, P[0]) == 1
    r.evicted(1, keys[:8], received=3)  # its first block is gone: nothing of P[0] can be hit there
    assert route(r, P[0] + [1] * 4) == 0  # by load now
    assert r.evicted_keys == 5
    r.evicted(7, keys, received=9)  # not a rank of this job: ignored
    assert r.evicted_keys == 5


def test_new_weights_forget_what_the_ranks_held():
    r = router()
    assert route(r, P[0]) == 0 and route(r, P[1]) == 1
    r.heard((1, 1))
    r._alloc.hash_key = b"m\0weights:1"  # what DynamicInferenceContext.weights_changed does
    assert route(r, P[0]) == 0  # the new key space: no rank holds anything, by load
    assert (r.view.num_keys(0), r.view.num_keys(1)) == (4, 0)  # the old keys forgotten


def test_nothing_is_hashed_where_routing_does_not_read_the_caches():
    assert router(DpRouting.LOAD_BALANCED).digests(P[0]) == []
    assert router(caching=False).digests(P[0]) == []
    assert not router(caching=False).slots[0].affinity
    assert router(DpRouting.SCORED).digests(P[0]) == prefix_digests(P[0], 4, b"m")


def test_a_rank_reports_the_keys_of_what_its_cache_reclaimed():
    alloc = KVBlockAllocator(3, True, b"m")  # 2 usable blocks
    assert take_evicted(None) == b""  # not recording
    evicted = alloc.record_evictions()
    h = chain_hash(None, [1, 2], b"m")
    block = alloc.allocate()
    alloc.register(block, h)
    alloc.release([block])
    alloc.allocate()
    alloc.allocate()  # reclaims the cached block
    packed = take_evicted(evicted)
    assert keys_from_bytes(packed) == [int.from_bytes(h.digest[:8], "little", signed=True)]
    assert take_evicted(evicted) == b"" and evicted == []


def test_digests_a_coordinators_client_computed_are_read_not_computed_again(monkeypatch):
    from megatron_async.inference.contexts import kv_block_allocator as kv

    known = b"".join(prefix_digests(P[0], 4, b"m"))  # an expert-parallel job behind a coordinator
    stale = b"".join(prefix_digests(P[0], 4, b"m\0weights:0"))  # hashed before the weights changed
    count, digest = [0], kv._digest
    monkeypatch.setattr(kv, "_digest", lambda m: (count.__setitem__(0, count[0] + 1), digest(m))[1])
    r = router()
    assert r.digests(P[0], known) == prefix_digests(P[0], 4, b"m")
    assert count[0] == 1 + 4  # the first block checked here, then the reference
    count[0] = 0
    assert r.digests(P[0], stale) == prefix_digests(P[0], 4, b"m") and count[0] == 1 + 4 + 4  # hashed anew
