"""KVBlockAllocator: free list, dummy block, ref counts, prefix hashes, LRU reclaim."""
import pytest

from megatron_async.inference.contexts.kv_block_allocator import DUMMY_BLOCK, KVBlockAllocator, chain_hash


def _drain(alloc: KVBlockAllocator) -> list[int]:
    out = []
    while (b := alloc.allocate()) is not None:
        out.append(b)
    return out


def test_allocate_release_reuse():
    alloc = KVBlockAllocator(5, enable_prefix_caching=False)
    assert alloc.capacity == 4 and alloc.num_available == 4
    a, b = alloc.allocate(), alloc.allocate()
    assert a != b and alloc.ref_count(a) == alloc.ref_count(b) == 1
    assert alloc.num_available == 2
    alloc.release([a])
    assert alloc.ref_count(a) == 0 and alloc.num_available == 3
    assert a in _drain(alloc)


def test_dummy_block_never_handed_out_and_exhaustion_returns_none():
    alloc = KVBlockAllocator(6, enable_prefix_caching=True)
    got = _drain(alloc)
    assert sorted(got) == [1, 2, 3, 4, 5] and DUMMY_BLOCK not in got
    assert alloc.allocate() is None and alloc.num_available == 0
    alloc.release(got)
    assert DUMMY_BLOCK not in _drain(alloc)


def test_at_least_two_blocks():
    with pytest.raises(ValueError):
        KVBlockAllocator(1, enable_prefix_caching=False)


def test_double_release_asserts():
    alloc = KVBlockAllocator(4, enable_prefix_caching=False)
    b = alloc.allocate()
    alloc.release([b])
    with pytest.raises(AssertionError):
        alloc.release([b])


def test_shared_prefix_block_ref_counts():
    alloc = KVBlockAllocator(4, enable_prefix_caching=True)
    b = alloc.allocate()
    h = chain_hash(None, (1, 2, 3, 4))
    alloc.register(b, h)
    assert alloc.lookup(h) == b
    alloc.acquire_cached(b)  # a second request shares it
    assert alloc.ref_count(b) == 2
    alloc.release([b])
    assert alloc.ref_count(b) == 1 and alloc.num_available == 2  # still held: neither free nor cached
    alloc.release([b])
    assert alloc.ref_count(b) == 0 and alloc.num_available == 3  # cached, reclaimable
    assert alloc.lookup(h) == b
    alloc.acquire_cached(b)  # reuse straight from the cache
    assert alloc.ref_count(b) == 1 and alloc.num_available == 2
    assert b not in _drain(alloc)


def test_register_is_first_wins_and_idempotent():
    alloc = KVBlockAllocator(4, enable_prefix_caching=True)
    a, b = alloc.allocate(), alloc.allocate()
    h1, h2 = chain_hash(None, (1,)), chain_hash(None, (2,))
    alloc.register(a, h1)
    alloc.register(b, h1)  # same content already cached in `a`
    alloc.register(a, h2)  # `a` already has a hash
    assert alloc.lookup(h1) == a and alloc.lookup(h2) is None
    alloc.release([a, b])
    # the unregistered duplicate went back to the free list, the registered one is cached
    assert alloc.lookup(h1) == a
    assert alloc.allocate() == b


def test_chain_hash_depends_on_parent_and_tokens():
    root = chain_hash(None, (1, 2))
    assert chain_hash(None, (1, 2)) == root
    assert chain_hash(root, (3, 4)) != chain_hash(chain_hash(None, (9, 9)), (3, 4))
    assert chain_hash(None, (2, 1)) != root


def test_lru_reclaims_oldest_released_first_and_calls_back():
    alloc = KVBlockAllocator(4, enable_prefix_caching=True)
    blocks = _drain(alloc)  # 3 blocks
    hashes = [chain_hash(None, (i,)) for i in range(3)]
    for b, h in zip(blocks, hashes):
        alloc.register(b, h)
    reclaimed = []
    alloc.on_reclaim = lambda block, block_hash: reclaimed.append((block, block_hash))
    order = [blocks[1], blocks[2], blocks[0]]  # release order = LRU age
    for b in order:
        alloc.release([b])
    assert alloc.num_available == 3
    first = alloc.allocate()
    assert first == blocks[1] and reclaimed == [(blocks[1], hashes[1])]
    assert alloc.lookup(hashes[1]) is None and alloc.lookup(hashes[2]) == blocks[2]
    # touching a cached block (acquire + release) makes it the newest
    alloc.acquire_cached(blocks[2])
    alloc.release([blocks[2]])
    assert alloc.allocate() == blocks[0]
    assert alloc.allocate() == blocks[2]
    assert reclaimed == [(blocks[i], hashes[i]) for i in (1, 0, 2)]
    assert alloc.allocate() is None


def test_free_blocks_are_used_before_cached_ones():
    alloc = KVBlockAllocator(4, enable_prefix_caching=True)
    a = alloc.allocate()
    alloc.register(a, chain_hash(None, (7,)))
    alloc.release([a])
    assert a not in (alloc.allocate(), alloc.allocate())
    assert alloc.allocate() == a  # only now is the cached block reclaimed


def test_prefix_caching_off_never_finds_blocks():
    alloc = KVBlockAllocator(4, enable_prefix_caching=False)
    b = alloc.allocate()
    h = chain_hash(None, (1, 2))
    alloc.register(b, h)
    assert alloc.lookup(h) is None
    alloc.release([b])
    assert alloc.num_available == 3 and b in _drain(alloc)


def test_block_identity_is_a_sha256_chain_over_token_bytes():
    import hashlib

    from megatron_async.inference.contexts.kv_block_allocator import chain_hash as ch

    root = ch(None, [1, 2], key=b"m")
    child = ch(root, [3, 4], key=b"m")
    tokens = (3).to_bytes(8, "little") + (4).to_bytes(8, "little")
    assert child.digest == hashlib.sha256(root.digest + tokens).digest()
    assert ch(None, [1, 2], key=b"other") != root  # the model / adapter key separates pools
    assert ch(None, [1, 2], key=b"m") == root and hash(ch(None, [1, 2], key=b"m")) == hash(root)


def test_colliding_digests_never_alias_blocks(monkeypatch):
    """Even if the digest collided (forced here), the compared content keeps blocks apart."""
    from megatron_async.inference.contexts import kv_block_allocator as kv

    monkeypatch.setattr(kv, "_digest", lambda message: b"\0" * 32)
    alloc = KVBlockAllocator(4, enable_prefix_caching=True)
    a, b = alloc.block_hash(None, (1, 2)), alloc.block_hash(None, (2, 1))
    assert a.digest == b.digest and hash(a) == hash(b)  # a full collision of the weak digest
    block = alloc.allocate()
    alloc.register(block, a)
    assert alloc.lookup(b) is None and alloc.lookup(alloc.block_hash(None, (1, 2))) == block
