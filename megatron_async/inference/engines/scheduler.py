"""Admission, chunked prefill and the pause / evict policy: builds one StepPlan.

Order of service (oldest request first within each class): decode rows, unfinished
prefills, paused requests resuming, then new admissions (only while nothing is paused).
A decode row that cannot get a block for its next token is paused (it keeps its blocks).
If a step would otherwise schedule nothing while requests are paused, the newest paused
requests are evicted (blocks released, recomputed later) until the oldest can move, so
the engine always makes progress. Requests with a sample still in flight are scheduled
only from the launch that made it (their input is gathered on the device)."""
from __future__ import annotations

from collections import deque

from megatron_async.config import InferenceConfig
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.engines.step_plan import RowPlan, StepPlan
from megatron_async.inference.request import DynamicInferenceRequest, Status


class Scheduler:
    def __init__(self, config: InferenceConfig, context: DynamicInferenceContext):
        self.config = config
        self.ctx = context
        self.waiting: deque[DynamicInferenceRequest] = deque()
        self.num_paused_events = 0
        self.num_evicted_events = 0
        self.prefix_hit_tokens = 0

    def add(self, req: DynamicInferenceRequest) -> None:
        self.waiting.append(req)

    def requeue_front(self, req: DynamicInferenceRequest) -> None:
        self.waiting.appendleft(req)

    def remove_waiting(self, req: DynamicInferenceRequest) -> None:
        self.waiting.remove(req)

    def wants_token(self, req: DynamicInferenceRequest) -> bool:
        """More tokens may be sampled without passing a length limit known on the CPU."""
        sp = req.sampling_params
        return (
            req.tokens_budgeted < sp.num_tokens_to_generate
            and req.num_known_tokens + req.num_inflight < self.config.max_sequence_length
        )

    def _decode_row(self, req: DynamicInferenceRequest) -> RowPlan:
        prev = req.inflight_row if req.num_inflight else -1
        return RowPlan(req, req.num_computed_tokens, 1, samples=True, prev_row=prev)

    def schedule(self, has_inflight: bool) -> StepPlan:
        ctx = self.ctx
        if has_inflight:
            self.release_finishing()
        plan = StepPlan()
        budget = self.config.max_tokens
        by_age = sorted(ctx.active.values(), key=lambda r: r.arrival_order)

        # 1. decode rows
        for req in by_age:
            if req.status != Status.ACTIVE or req.is_prefilling or not self.wants_token(req):
                continue
            if req.num_inflight and req.inflight_row < 0:
                continue
            if ctx.reserve(req, 1):
                plan.rows.append(self._decode_row(req))
                budget -= 1
            else:
                ctx.pause(req)
                self.num_paused_events += 1

        # 2. unfinished prefills (and recomputes of evicted requests); no block -> paused
        for req in by_age:
            if budget <= 0:
                break
            if req.status == Status.ACTIVE and req.is_prefilling:
                used = self._schedule_prefill(req, budget, plan)
                if used == 0 and self._blocked_on_memory(req):
                    ctx.pause(req)
                    self.num_paused_events += 1
                budget -= used

        # 3. resume paused requests whose next token (or chunk) now has room
        for req in by_age:
            if budget <= 0:
                break
            if req.status != Status.PAUSED or req.num_inflight:
                continue
            if req.is_prefilling:
                used = self._schedule_prefill(req, budget, plan)
                if used:
                    ctx.resume(req)
                    budget -= used
            elif ctx.reserve(req, 1):
                ctx.resume(req)
                plan.rows.append(self._decode_row(req))
                budget -= 1

        # 4. admissions, FIFO, only while nothing is paused
        while (
            self.waiting and budget > 0 and len(ctx.active) < self.config.max_requests
            and not any(r.status == Status.PAUSED for r in ctx.active.values())
        ):
            req = self.waiting[0]
            if req.num_inflight:
                break  # an evicted request whose last sample has not landed yet
            hit = ctx.admit(req)
            used = self._schedule_prefill(req, budget, plan)
            if used == 0:
                ctx.evict(req)  # undo the admission: back to waiting, prefix refs dropped
                break
            self.waiting.popleft()
            self.prefix_hit_tokens += hit
            budget -= used

        # 5. progress guarantee: nothing could move and nothing is in flight, so the pool is
        # held by requests that cannot grow; recompute the newest one later and retry.
        if not plan and not has_inflight and ctx.active:
            victim = max(ctx.active.values(), key=lambda r: r.arrival_order)
            ctx.evict(victim)
            self.num_evicted_events += 1
            self.requeue_front(victim)
            return self.schedule(has_inflight)
        return plan

    def release_finishing(self) -> None:
        """Launch-ahead schedules step N+1 before step N is bookkept. A request whose last token
        is in flight reaches its length limit when N lands, and the serial engine releases it
        before scheduling N+1; releasing it here frees the same blocks, state slot and request
        place, so both modes build the same schedules (on the GPU a different schedule means
        different bf16 rounding, and different greedy tokens). Stream order keeps N's KV writes
        before any next owner's. Finishes by EOS / stop words cannot be foreseen: after one,
        launch-ahead still schedules one step with the request's blocks held."""
        done = [r for r in self.ctx.active.values()
                if r.num_inflight and r.status == Status.ACTIVE and not self.wants_token(r)]
        for req in done:
            self.ctx.release_ahead(req)

    def _whole_prompt_only(self, req: DynamicInferenceRequest) -> bool:
        # A recompute after eviction may exceed max_tokens although its prompt did not:
        # it is chunked even when chunked prefill is off, or it could never run again.
        return not self.config.enable_chunked_prefill and not req.generated_tokens

    def _blocked_on_memory(self, req: DynamicInferenceRequest) -> bool:
        """The next prefill chunk cannot get KV blocks (as opposed to: no token budget left)."""
        remaining = req.num_known_tokens - req.num_computed_tokens
        return self.ctx.reservable_tokens(req) < (remaining if self._whole_prompt_only(req) else 1)

    def _schedule_prefill(self, req: DynamicInferenceRequest, budget: int, plan: StepPlan) -> int:
        """Schedule the next prefill chunk of ``req``; returns tokens used (0 = none fit)."""
        remaining = req.num_known_tokens - req.num_computed_tokens
        chunk = min(remaining, budget, self.ctx.reservable_tokens(req))
        start = req.num_computed_tokens
        if self._whole_prompt_only(req):
            return self._append_prefill(req, start, remaining, remaining, plan) if chunk == remaining else 0
        for point in req.mamba_store_points:  # end the chunk where a state must be cached
            if start < point < start + chunk:
                chunk = point - start
                break
        return self._append_prefill(req, start, chunk, remaining, plan)

    def _append_prefill(self, req: DynamicInferenceRequest, start: int, chunk: int, remaining: int, plan: StepPlan) -> int:
        if chunk <= 0 or not self.ctx.reserve(req, chunk):
            return 0
        plan.rows.append(RowPlan(req, start, chunk, samples=chunk == remaining))
        return chunk
