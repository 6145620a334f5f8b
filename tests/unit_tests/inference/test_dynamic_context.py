"""DynamicInferenceContext resources through the request book's transitions (activate / reserve /
pause / resume / evict / finish) and prefix-block publication (the step tables it writes:
test_context_step_tables.py)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_async.inference.engines.request_book import RequestBook  # noqa: E402
from megatron_async.inference.request import FinishReason, Status  # noqa: E402
from megatron_async.inference.step_plan import RowPlan, StepPlan  # noqa: E402
from megatron_async.models import build_default_model  # noqa: E402
from tests.helpers.context_harness import (  # noqa: E402
    assemble_and_commit, land, make_ctx, make_req, run_prefill,
)


@pytest.fixture(scope="module")
def model():
    return build_default_model("tiny", "cpu", torch.float32)


# ---------------------------------------------------------------- transitions
def test_admit_without_cache_hit(model):
    ctx = make_ctx(model)
    req = make_req(0, range(10))
    assert RequestBook(ctx).activate(req) == 0
    assert req.status == Status.ACTIVE and ctx.active == {0: req}
    assert req.num_computed_tokens == 0 and req.block_ids == []


def test_prefix_hit_skips_cached_blocks_but_leaves_a_token_to_compute(model):
    ctx = make_ctx(model)
    a = make_req(0, range(12))  # 3 complete blocks
    RequestBook(ctx).activate(a)
    run_prefill(ctx, a)
    assert a.num_hashed_blocks == 3
    cached = list(a.block_ids)
    RequestBook(ctx).finish(a, FinishReason.LENGTH)
    assert ctx.allocator.num_available == 8  # cached blocks stay obtainable

    same = make_req(1, range(12))  # fully cached: the last block is recomputed for its logits
    assert RequestBook(ctx).activate(same) == 8
    assert same.num_computed_tokens == 8 and same.block_ids == cached[:2]
    longer = make_req(2, list(range(12)) + [50])
    assert RequestBook(ctx).activate(longer) == 12 and longer.block_ids == cached
    diverging = make_req(3, [0, 1, 2, 3, 99, 5, 6, 7, 8])
    assert RequestBook(ctx).activate(diverging) == 4
    assert ctx.allocator.ref_count(same.block_ids[0]) == 3  # first block shared three ways
    assert diverging.block_ids == cached[:1] and ctx.allocator.ref_count(cached[2]) == 1


def test_reserve_is_all_or_nothing_across_block_boundaries(model):
    ctx = make_ctx(model, num_kv_blocks=4, prefix_caching=False)  # 3 usable blocks
    req = make_req(0, range(20))
    RequestBook(ctx).activate(req)
    assert ctx.reservable_tokens(req) == 12
    assert not ctx.reserve(req, 13)  # needs 4 blocks
    assert req.block_ids == [] and ctx.allocator.num_available == 3
    assert ctx.reserve(req, 5)  # 2 blocks
    assert len(req.block_ids) == 2 and ctx.allocator.num_available == 1
    assemble_and_commit(ctx, StepPlan([RowPlan(req, 0, 5, samples=False)]))
    assert ctx.reservable_tokens(req) == 3 + 4  # slack in block 2 + one free block
    assert ctx.reserve(req, 3) and len(req.block_ids) == 2  # fits in the slack: no new block
    assert not ctx.reserve(req, 8)
    assert len(req.block_ids) == 2 and ctx.allocator.num_available == 1


def test_pause_and_resume_keep_blocks(model):
    ctx = make_ctx(model)
    req = make_req(0, range(6))
    RequestBook(ctx).activate(req)
    run_prefill(ctx, req)
    blocks, avail = list(req.block_ids), ctx.allocator.num_available
    RequestBook(ctx).pause(req)
    assert req.status == Status.PAUSED and req.block_ids == blocks and 0 in ctx.active
    RequestBook(ctx).resume(req)
    assert req.status == Status.ACTIVE and req.block_ids == blocks
    assert ctx.allocator.num_available == avail and req.num_computed_tokens == 6


def test_evict_frees_blocks_and_resets_computed_tokens(model):
    ctx = make_ctx(model, prefix_caching=False)
    req = make_req(0, range(6))
    RequestBook(ctx).activate(req)
    run_prefill(ctx, req)
    land(req, 7)
    RequestBook(ctx).evict(req)
    assert req.status == Status.WAITING and req.block_ids == [] and req.num_computed_tokens == 0
    assert ctx.active == {} and ctx.allocator.num_available == ctx.allocator.capacity
    assert req.generated_tokens == [7]  # kept: recomputed as part of the prefix later
    assert RequestBook(ctx).activate(req) == 0 and req.num_known_tokens == 7


def test_release_keeps_complete_hashed_blocks_cached(model):
    ctx = make_ctx(model)
    req = make_req(0, range(6))  # one complete block + a partial one
    RequestBook(ctx).activate(req)
    run_prefill(ctx, req)
    full, partial = req.block_ids
    h = ctx.allocator.block_hash(None, (0, 1, 2, 3))
    assert ctx.allocator.lookup(h) == full
    RequestBook(ctx).finish(req, FinishReason.LENGTH)
    assert req.status == Status.FINISHED and ctx.active == {}
    assert ctx.allocator.ref_count(full) == ctx.allocator.ref_count(partial) == 0
    assert ctx.allocator.lookup(h) == full  # still findable
    # the partial block went to the free list and is handed out before the cached one
    got = [ctx.allocator.allocate() for _ in range(ctx.allocator.capacity)]
    assert got[-1] == full and partial in got[:-1]


def test_register_only_publishes_blocks_known_and_computed(model):
    ctx = make_ctx(model)
    req = make_req(0, range(11))
    RequestBook(ctx).activate(req)
    run_prefill(ctx, req, 5)  # computed 5 of 11 known
    assert req.num_hashed_blocks == 1
    run_prefill(ctx, req, 2)  # computed 7: block 2 is still incomplete
    assert req.num_hashed_blocks == 1
    run_prefill(ctx, req)  # computed 11, samples position 11
    assert req.num_hashed_blocks == 2
    # launch-ahead decode of the in-flight sample: position 11 computed, its token unknown
    assert ctx.reserve(req, 1)
    assemble_and_commit(ctx, StepPlan([RowPlan(req, 11, 1, samples=True, prev_row=0)]))
    assert req.num_computed_tokens == 12 and req.num_known_tokens == 11
    assert req.num_hashed_blocks == 2  # block 3 waits for its last token
    land(req, 42)
    ctx.register_complete_blocks(req)
    assert req.num_hashed_blocks == 3
    bh = ctx.allocator.block_hash
    h3 = bh(bh(bh(None, (0, 1, 2, 3)), (4, 5, 6, 7)), (8, 9, 10, 42))
    assert ctx.allocator.lookup(h3) == req.block_ids[2] and req.last_block_hash == h3


def test_register_is_a_no_op_without_prefix_caching_or_sharing(model):
    ctx = make_ctx(model, prefix_caching=False, share=False)
    req = make_req(0, range(8))
    RequestBook(ctx).activate(req)
    run_prefill(ctx, req)
    assert req.num_hashed_blocks == 0
    assert ctx.allocator.lookup(ctx.allocator.block_hash(None, (0, 1, 2, 3))) is None


def test_without_prefix_caching_whole_prompts_are_shared_while_held(model):
    ctx = make_ctx(model, prefix_caching=False)
    book = RequestBook(ctx)
    owner = make_req(0, range(9))  # two complete blocks a copy may take
    book.activate(owner)
    run_prefill(ctx, owner)
    land(owner, 50)
    run_prefill(ctx, owner)  # a decode row: generated tokens' blocks are never published
    assert owner.num_hashed_blocks == 2
    same, partial = make_req(1, range(9)), make_req(2, [0, 1, 2, 3, 9, 9, 9, 9, 9])
    assert book.activate(same) == 8 and book.activate(partial) == 0  # only a whole prompt's blocks
    assert same.block_ids == owner.block_ids[:2]
    first = owner.block_ids[0]
    for r in (owner, same, partial):
        ctx.release(r)
    assert ctx.allocator.lookup(ctx.allocator.block_hash(None, (0, 1, 2, 3))) is None  # not cached
    assert ctx.allocator.ref_count(first) == 0 and ctx.allocator.num_available == 8
