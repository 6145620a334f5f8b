"""Routing with planted cache states: longest match wins, load overrides affinity at low alpha,
eviction reports remove affinity, ties go to the lowest index; and a multi-turn simulation that
shows what each policy keeps of one engine's prefix hits."""
from __future__ import annotations

import random

import pytest

from megatron_async.config import DpRouting
from megatron_async.coordinator.engines import EngineInfo, EngineSlot
from megatron_async.inference.dp_routing import PrefixView, choose, keys_of, place, routing_keys
from megatron_async.inference.contexts.kv_block_allocator import KVBlockAllocator, chain_hash, prefix_digests

P = DpRouting


def engines(*pending, max_requests=8, view=None):
    slots = [EngineSlot(i, EngineInfo(f"e{i}", max_requests, 1000, 16, b"m", True), pending=p)
             for i, p in enumerate(pending)]
    if view is not None:
        for s in slots:
            view.add_engine(s.index, 1000)
    return slots


def test_longest_match_wins():
    view, keys = PrefixView(), [11, 12, 13, 14]
    eng = engines(0, 0, 3, view=view)
    view.assign(0, keys[:1], 1)
    view.assign(2, keys[:3], 1)
    view.assign(1, [12, 13, 14], 1)  # the tail without the head: cannot be hit, depth 0
    assert view.depths(keys, 0b111) == {0: 1, 2: 3}
    for policy in (P.LONGEST_PREFIX, P.SCORED):
        assert choose(policy, keys, eng, view, alpha=0.9).index == 2
    eng[0].pending = 1
    eng[2].pending = 0
    assert choose(P.FIRST_PREFIX_BLOCK, keys, eng, view).index == 2  # both hold the head: the more free one


def test_load_overrides_affinity_at_low_alpha():
    view, keys = PrefixView(), [1, 2, 3, 4]
    eng = engines(0, 6, view=view)  # the holder is 6/8 busy
    view.assign(1, keys, 1)
    assert choose(P.SCORED, keys, eng, view, alpha=0.9).index == 1
    assert choose(P.SCORED, keys, eng, view, alpha=0.1).index == 0
    assert choose(P.LOAD_BALANCED, keys, eng, view).index == 0
    eng[1].pending = 8  # full: affinity cannot place it there at any alpha
    assert choose(P.LONGEST_PREFIX, keys, eng, view).index == 0
    eng[0].pending, eng[1].pending = 9, 8  # every engine full: the least overfull queues it
    for policy in P:
        assert choose(policy, keys, eng, view, alpha=0.5).index == 1


def test_eviction_reports_remove_affinity():
    view, keys = PrefixView(), [1, 2, 3, 4]
    eng = engines(0, 0, view=view)
    view.assign(1, keys, 1)
    view.assign(0, keys[:2], 1)
    assert choose(P.LONGEST_PREFIX, keys, eng, view).index == 1
    view.evict(1, [2], seen_seq=1)  # the parent of 3 and 4 is gone on engine 1: its depth is 1 now
    assert view.depths(keys, 0b11) == {0: 2, 1: 1}
    assert choose(P.LONGEST_PREFIX, keys, eng, view).index == 0
    view.evict(0, [1], seen_seq=1)
    assert choose(P.LONGEST_PREFIX, keys, eng, view).index == 1  # engine 0 lost its head block


def test_an_eviction_older_than_a_new_assignment_keeps_the_key():
    view, keys = PrefixView(), [5, 6]
    eng = engines(0, 0, view=view)
    view.assign(1, keys, 3)
    view.assign(1, keys, 7)  # routed there again: the engine computes the blocks anew
    view.evict(1, keys, seen_seq=5)  # reclaimed before it received submission 7
    assert choose(P.LONGEST_PREFIX, keys, eng, view).index == 1
    view.evict(1, keys, seen_seq=7)
    assert 6 not in view.holders and choose(P.LONGEST_PREFIX, keys, eng, view).index == 0


def test_ties_go_to_the_lowest_index_and_routing_is_deterministic():
    view = PrefixView()
    eng = engines(2, 2, 2, view=view)
    for policy in P:
        assert choose(policy, [5, 6], eng, view).index == 0
    view.assign(1, [5, 6], 1)
    view.assign(2, [5, 6], 1)
    eng = engines(0, 1, 1)
    for policy in (P.LONGEST_PREFIX, P.FIRST_PREFIX_BLOCK):
        assert choose(policy, [5, 6], eng, view).index == 1
    assert choose(P.SCORED, [5, 6], engines(2, 2, 2), view, alpha=0.5).index == 1


def test_groups_stay_together_unless_full_and_engines_without_affinity_are_placed_by_load():
    view, keys = PrefixView(), [7, 8]
    eng = engines(0, 0, view=view)
    view.assign(0, keys, 1)
    assert [e.index for e in place(P.LONGEST_PREFIX, keys, eng, view, n=8)] == [0] * 8
    eng[0].pending = 1  # 1 + 8 > 8 slots: the group goes to engine 1, whole
    assert [e.index for e in place(P.LONGEST_PREFIX, keys, eng, view, n=8)] == [1] * 8
    eng[1].pending = 4  # nobody has 8 slots: one by one, the holder first while it has room
    placed = [e.index for e in place(P.LONGEST_PREFIX, keys, eng, view, n=8)]
    assert placed.count(0) == 7 and placed.count(1) == 1 and eng[0].pending == 1  # nothing counted by place
    eng = engines(3, 0)
    assert choose(P.LONGEST_PREFIX, keys, eng, view).index == 0
    eng[0].affinity = False  # prefix caching off there, or another key space: its view is not read
    assert choose(P.LONGEST_PREFIX, keys, eng, view).index == 1
    assert choose(P.LONGEST_PREFIX, keys, [], view) is None and place(P.SCORED, keys, [], view) == []


def test_the_view_holds_at_most_an_engines_capacity():
    view = PrefixView()
    view.add_engine(0, 4)
    view.assign(0, [1, 2, 3], 1)
    view.assign(0, [4, 5], 2)  # the oldest goes
    assert view.num_keys(0) == 4 and 1 not in view.holders and view.holders[5] == 1
    view.forget_engine(0)
    assert view.holders == {}


def test_keys_are_the_prefix_caches_own_chain():
    prompt = list(range(40))
    keys = routing_keys(prompt, 16, b"GPT")
    h0 = chain_hash(None, prompt[:16], b"GPT")
    h1 = chain_hash(h0, prompt[16:32], b"GPT")
    assert prefix_digests(prompt, 16, b"GPT") == [h0.digest, h1.digest]
    assert keys == keys_of([h0.digest, h1.digest]) and keys[0] == int.from_bytes(h0.digest[:8], "little", signed=True)
    assert routing_keys(list(range(32)), 16, b"GPT") == keys[:1]  # the last token is always computed
    assert routing_keys(prompt, 16, b"GPT\0weights:1") != keys  # new weights: no old affinity
    alloc = KVBlockAllocator(4, True, b"GPT")
    assert alloc.block_hash(None, prompt[:16]).digest == h0.digest


def test_the_allocator_reports_what_it_reclaims_to_every_reader():
    alloc = KVBlockAllocator(3, True, b"m")  # 2 usable blocks
    link, router = alloc.record_evictions(), alloc.record_evictions()  # an engine link and rank 0's router
    h = [chain_hash(None, [1, 2], b"m")]
    h.append(chain_hash(h[0], [3, 4], b"m"))
    blocks = [alloc.allocate(), alloc.allocate()]
    for b, key in zip(blocks, h):
        alloc.register(b, key)
    alloc.release(blocks)
    assert link == [] and router == []
    alloc.allocate()  # reclaims the oldest cached block
    assert link == [h[0].digest] and router == [h[0].digest]
    link.clear()  # one reader taking its reports leaves the other's
    alloc.allocate()
    assert link == [h[1].digest] and router == [h[0].digest, h[1].digest]


def simulate(policy: DpRouting, num_engines: int, alpha: float = 0.5, seed: int = 0) -> tuple[float, list[int]]:
    """64 conversations x 4 turns, each turn's prompt = the previous turns + 32 answer tokens + 32
    new ones; engines with ample KV: prefix-hit share of the prompts' hittable tokens, and the
    requests per engine. Every conversation's turn t is in flight at once (64 slots per engine)."""
    rng, bs = random.Random(seed), 16
    view = PrefixView()
    slots = engines(*[0] * num_engines, max_requests=64, view=view)
    held = [set() for _ in range(num_engines)]  # what each engine's cache really holds
    convs = [[rng.randrange(1000) for _ in range(48)] for _ in range(64)]
    hit = total = 0
    counts = [0] * num_engines
    for turn in range(4):
        for s in slots:
            s.pending = 0
        for c in rng.sample(range(64), 64):
            prompt = convs[c]
            keys = routing_keys(prompt, bs, b"m")
            e = choose(policy, keys, slots, view, alpha)
            counts[e.index] += 1
            e.pending += 1
            depth = next((i for i, k in enumerate(keys) if k not in held[e.index]), len(keys))
            hit, total = hit + depth, total + len(keys)
            full = prompt + [rng.randrange(1000) for _ in range(32)]
            held[e.index].update(routing_keys(full + [0], bs, b"m"))  # prompt + answer blocks registered
            view.assign(e.index, keys, turn)
            convs[c] = full + [rng.randrange(1000) for _ in range(32)]
    return hit / total, counts


@pytest.mark.parametrize("policy", [P.LONGEST_PREFIX, P.SCORED])
def test_affinity_keeps_most_of_one_engines_prefix_hits(policy):
    one, _ = simulate(P.LONGEST_PREFIX, 1)
    four, counts = simulate(policy, 4, alpha=0.7)
    assert four >= 0.9 * one, (four, one)
    assert max(counts) <= 1.5 * min(counts), counts
    spread, _ = simulate(P.LOAD_BALANCED, 4)
    assert spread < 0.6 * one  # for contrast: spreading the turns loses most hits
