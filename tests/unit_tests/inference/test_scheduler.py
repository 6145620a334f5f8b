"""Scheduler policy, driven without a model: plans are assembled by the real context and
committed by the real request book, and samples "land" the way the book appends them."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_async import InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext  # noqa: E402
from megatron_async.inference.device import DeviceFacade  # noqa: E402
from megatron_async.inference.engines.request_book import RequestBook  # noqa: E402
from megatron_async.inference.engines.scheduler import Scheduler  # noqa: E402
from megatron_async.inference.request import DynamicInferenceRequest, FinishReason, Status  # noqa: E402
from megatron_async.inference.speculative.policy import SpecPolicy  # noqa: E402
from megatron_async.inference.step_plan import StepPlan  # noqa: E402
from megatron_async.models import build_default_model  # noqa: E402

BS = 4


@pytest.fixture(scope="module")
def model():
    return build_default_model("tiny", "cpu", torch.float32)


class Driver:
    """Scheduler + context; ``step`` schedules and assembles, ``land`` bookkeeps samples."""

    def __init__(self, model, num_kv_blocks=64, max_requests=4, max_tokens=8, chunked=True, **cfg):
        cfg = InferenceConfig(block_size_tokens=BS, num_kv_blocks=num_kv_blocks, max_requests=max_requests,
                              max_tokens=max_tokens, max_sequence_length=64, enable_chunked_prefill=chunked, **cfg)
        self.ctx = DynamicInferenceContext(cfg.cache_sizing(), model, DeviceFacade("cpu"), torch.float32)
        self.sched = Scheduler(cfg.scheduling(), self.ctx, RequestBook(self.ctx, SpecPolicy(cfg.speculation())))
        self.max_tokens = max_tokens
        self._arrivals = 0

    def add(self, prompt_len: int, num_tokens: int = 4) -> DynamicInferenceRequest:
        rid = self._arrivals
        sp = SamplingParams(top_k=1, num_tokens_to_generate=num_tokens)
        req = DynamicInferenceRequest(rid, [rid + 1] * prompt_len, sp, seed=rid, arrival_order=rid)
        self._arrivals += 1
        self.sched.add(req)
        return req

    def step(self, has_inflight: bool = False) -> StepPlan:
        plan = self.sched.schedule(has_inflight)
        assert plan.num_tokens <= self.max_tokens
        self.ctx.initialize_attention_state(plan)
        self.sched.book.commit(plan)
        return plan

    def land(self, plan: StepPlan) -> list[DynamicInferenceRequest]:
        finished = []
        for row in plan.rows:
            if not row.samples or row.request.status == Status.FINISHED:
                continue
            req = row.request
            req.num_inflight -= 1
            if req.num_inflight == 0:
                req.inflight_row = -1
            req.generated_tokens.append(7)
            if len(req.generated_tokens) >= req.sampling_params.num_tokens_to_generate:
                self.sched.book.finish(req, FinishReason.LENGTH)
                finished.append(req)
        return finished

    def serial(self) -> StepPlan:
        plan = self.step()
        self.land(plan)
        return plan


def rows(plan: StepPlan) -> list[tuple[int, int, int]]:
    """(request id, start, num_tokens) per row, in launch order."""
    return [(r.request.request_id, r.start, r.num_tokens) for r in plan.rows]


def test_chunked_prefill_stays_within_max_tokens(model):
    d = Driver(model, max_tokens=8)
    r = d.add(20)
    plans = [d.serial() for _ in range(4)]
    assert [rows(p) for p in plans] == [[(0, 0, 8)], [(0, 8, 8)], [(0, 16, 4)], [(0, 20, 1)]]
    assert [p.rows[0].samples for p in plans] == [False, False, True, True]  # only the last chunk samples
    assert r.generated_tokens == [7, 7]


def test_decode_rows_come_before_prefills(model):
    d = Driver(model, max_tokens=8)
    a, b = d.add(2), d.add(3)
    d.serial()
    c = d.add(20)
    plan = d.serial()
    assert rows(plan) == [(0, 2, 1), (1, 3, 1), (2, 0, 6)]  # decodes kept whole, the chunk gets the rest
    assert [r.samples for r in plan.rows] == [True, True, False]
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (3, 4, 6)


def test_inflight_decode_rows_precede_older_prefills(model):
    d = Driver(model, max_tokens=8)
    b = d.add(2, num_tokens=8)
    d.step()  # b samples; its token is still in flight
    older = DynamicInferenceRequest(99, [5] * 20, SamplingParams(top_k=1), seed=0,
                                    arrival_order=-1)  # e.g. the recompute of an evicted request
    d.sched.requeue_front(older)
    assert rows(d.step(has_inflight=True)) == [(0, 2, 1), (99, 0, 7)]
    plan = d.step(has_inflight=True)  # older is now an active prefill, older than b
    assert rows(plan) == [(0, 3, 1), (99, 7, 7)]
    assert plan.rows[0].prev_row == 0 and b.num_inflight == 3


def test_inflight_samples_are_read_on_the_device(model):
    d = Driver(model, max_tokens=8)
    a, b = d.add(2, num_tokens=2), d.add(3, num_tokens=5)
    first = d.step()
    assert [r.request.inflight_row for r in first.rows] == [0, 1]
    nxt = d.step(has_inflight=True)
    assert rows(nxt) == [(0, 2, 1), (1, 3, 1)] and [r.prev_row for r in nxt.rows] == [0, 1]
    assert d.ctx._host_views[d.ctx._ring]["prev_sample_idx"][:2].tolist() == [0, 1]
    assert (a.num_inflight, b.num_inflight) == (2, 2)
    d.land(first)
    assert (a.num_inflight, a.inflight_row, b.inflight_row) == (1, 0, 1)  # newest launch's rows
    # a's budget is used up, so b moves to row 0 but reads its sample from row 1 of `nxt`
    third = d.step(has_inflight=True)
    assert rows(third) == [(1, 4, 1)] and third.rows[0].prev_row == 1
    assert b.inflight_row == 0


def test_launch_ahead_stops_at_the_length_budget(model):
    d = Driver(model, max_tokens=8)
    r = d.add(2, num_tokens=2)
    first = d.step()
    second = d.step(has_inflight=True)  # the 2nd token
    assert rows(second) == [(0, 2, 1)] and r.tokens_budgeted == 2
    assert not d.sched.schedule(has_inflight=True)  # a 3rd would pass num_tokens_to_generate
    d.land(first)
    d.land(second)
    assert r.status == Status.FINISHED and len(r.generated_tokens) == 2


def test_max_requests_respected(model):
    d = Driver(model, max_requests=2)
    a, b, c = d.add(2, num_tokens=1), d.add(2, num_tokens=3), d.add(2)
    plan = d.serial()
    assert [r.request for r in plan.rows] == [a, b] and list(d.sched.waiting) == [c]
    assert a.status == Status.FINISHED and len(d.ctx.active) == 1
    plan = d.serial()
    assert [r.request for r in plan.rows] == [b, c]


def test_admission_is_fifo_without_overtaking(model):
    # 4 usable blocks; chunked prefill off, so the 8-token head needs 2 blocks at once
    d = Driver(model, num_kv_blocks=5, max_tokens=16, chunked=False)
    holder = d.add(8, num_tokens=2)
    d.serial()  # holder: 2 blocks
    head, small = d.add(8), d.add(2)
    plan = d.step()  # holder's next token takes a 3rd block: 1 left, head needs 2
    assert [r.request for r in plan.rows] == [holder]
    assert d.ctx.allocator.num_available == 1  # small would fit, but does not overtake head
    assert list(d.sched.waiting) == [head, small]
    assert head.status == Status.WAITING and head.block_ids == []
    d.land(plan)
    assert holder.status == Status.FINISHED
    plan = d.serial()
    assert [r.request for r in plan.rows] == [head, small]


def test_admission_order_is_arrival_order(model):
    d = Driver(model, max_tokens=16)
    reqs = [d.add(n) for n in (5, 1, 3)]
    plan = d.serial()
    assert [r.request for r in plan.rows] == reqs


def _two_full_blocks(model, num_kv_blocks: int) -> tuple[Driver, DynamicInferenceRequest, DynamicInferenceRequest]:
    """a fills a whole block (its next token needs a new one), b has slack in its block."""
    d = Driver(model, num_kv_blocks=num_kv_blocks)
    a, b = d.add(4, num_tokens=4), d.add(2, num_tokens=2)
    d.serial()
    return d, a, b


def test_pause_when_no_block_then_resume_with_blocks_kept(model):
    d, a, b = _two_full_blocks(model, num_kv_blocks=3)  # 2 usable blocks, both taken
    blocks = list(a.block_ids)
    plan = d.serial()
    assert rows(plan) == [(1, 2, 1)]  # b decodes in its slack
    assert a.status == Status.PAUSED and a.block_ids == blocks and d.sched.num_paused_events == 1
    assert b.status == Status.FINISHED  # its block is free now
    plan = d.serial()
    assert rows(plan) == [(0, 4, 1)] and a.status == Status.ACTIVE
    assert a.block_ids[:1] == blocks and len(a.block_ids) == 2


def test_no_admission_while_something_is_paused(model):
    d = Driver(model, num_kv_blocks=16)
    a, b = d.add(4), d.add(2)
    first = d.step()  # both sample; tokens in flight
    d.sched.book.pause(a)  # as if a's launch-ahead row had found no block
    w = d.add(2)
    plan = d.step(has_inflight=True)
    assert rows(plan) == [(1, 2, 1)]  # a cannot resume before its sample lands; w must wait
    assert list(d.sched.waiting) == [w] and d.ctx.allocator.num_available >= 2  # room was not the reason
    d.land(first)
    plan = d.step(has_inflight=True)
    # decode rows, then the resumed request, then admissions
    assert rows(plan) == [(1, 3, 1), (0, 4, 1), (2, 0, 2)]
    assert a.status == Status.ACTIVE and not d.sched.waiting


def test_eviction_for_progress_picks_the_newest(model):
    d = Driver(model, num_kv_blocks=4, max_tokens=16)  # 3 usable blocks
    reqs = [d.add(4, num_tokens=3) for _ in range(3)]  # each fills one block
    d.serial()
    assert d.ctx.allocator.num_available == 0
    plan = d.serial()  # all three need a block for their next token: evict the newest
    victim = reqs[2]
    assert d.sched.num_evicted_events == 1 and victim.status == Status.WAITING
    assert victim.block_ids == [] and victim.num_computed_tokens == 0 and victim.generated_tokens == [7]
    assert list(d.sched.waiting) == [victim]  # back at the front, recomputed later
    assert rows(plan) == [(0, 4, 1)]  # the oldest moves with the freed block
    assert reqs[1].status == Status.PAUSED


def test_no_eviction_while_a_launch_is_in_flight(model):
    d = Driver(model, num_kv_blocks=3)  # 2 usable blocks
    a, b = d.add(4), d.add(4)
    d.serial()  # both fill their block; neither can get one for its next token
    assert not d.sched.schedule(has_inflight=True)  # a launch in flight may free blocks: wait
    assert d.sched.num_evicted_events == 0 and a.status == b.status == Status.PAUSED
    plan = d.sched.schedule(has_inflight=False)
    assert d.sched.num_evicted_events == 1 and b.status == Status.WAITING
    assert [r.request for r in plan.rows] == [a]


def test_evicted_request_with_inflight_sample_blocks_admission(model):
    d = Driver(model)
    r = d.add(2)
    r.num_inflight = 1  # evicted while its last sample is still in flight
    assert not d.sched.schedule(has_inflight=True)
    assert list(d.sched.waiting) == [r]


def test_evicted_request_is_recomputed_with_chunked_prefill_off(model):
    d = Driver(model, num_kv_blocks=6, max_requests=2, max_tokens=8, chunked=False)  # 5 usable blocks
    a, b = d.add(7, num_tokens=8), d.add(7, num_tokens=8)  # 2 blocks each at admission
    for _ in range(40):
        if a.status == b.status == Status.FINISHED:
            break
        d.serial()
    assert d.sched.num_evicted_events >= 1  # b was evicted with 7 + 2 tokens to recompute
    assert a.status == Status.FINISHED and b.status == Status.FINISHED


def test_launch_ahead_releases_a_request_whose_last_token_is_in_flight(model):
    """The serial engine releases a length-finished request before scheduling the next step;
    launch-ahead schedules that step while the last token is in flight, so it releases the
    request then: both build the same plan, which a tight pool would otherwise prevent."""

    def second_plan(ahead: bool, release: bool = True):
        d = Driver(model, num_kv_blocks=5, max_requests=4, max_tokens=16)  # 4 usable blocks of 4 tokens
        if not release:
            d.sched.release_finishing = lambda: None
        a = d.add(12, num_tokens=1)  # its prefill samples its only (last) token
        b = d.add(8)
        first = d.step()
        assert rows(first) == [(a.request_id, 0, 12), (b.request_id, 0, 4)] and d.ctx.allocator.num_available == 0
        if not ahead:
            d.land(first)
            return rows(d.step()), a, d
        plan = d.step(has_inflight=True)
        assert d.land(first) == [a] and a.status == Status.FINISHED and a.generated_tokens == [7]
        return rows(plan), a, d

    serial, _, _ = second_plan(ahead=False)
    ahead, a, d = second_plan(ahead=True)
    assert serial == ahead == [(1, 4, 4)]  # b's second chunk, in a's freed blocks
    assert a.request_id not in d.ctx.active and not a.block_ids
    old, _, d_old = second_plan(ahead=True, release=False)
    assert old == [] and d_old.ctx.active[1].status == Status.PAUSED  # what launch-ahead did before


def test_waiting_requests_that_cannot_be_admitted_bring_no_prefill_chunks(model):
    """Adaptive speculation drafts nothing in a step with prefill chunks. Requests waiting while
    new ones are not admitted (``pause_generation("wait")``: a weight update) bring none, so
    drafting stays on, and the step before does not count on chunks either (``chunks_next``)."""
    d = Driver(model, max_tokens=16, num_speculative_tokens=2, speculative_adaptive=True)
    policy = d.sched.spec
    d.add(3)
    d.serial()
    d.add(3)
    d.sched.admits_new = False
    assert rows(d.serial()) == [(0, 3, 1)] and not policy.chunks_next
    assert policy.off_rows["prefill"] == 0, policy.off_rows
    d.sched.admits_new = True
    assert rows(d.serial()) == [(0, 4, 1), (1, 0, 3)] and policy.off_rows["prefill"] == 1, policy.off_rows
    d.add(30)
    d.serial()  # its first chunk does not end its prompt
    assert policy.chunks_next
