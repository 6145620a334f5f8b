"""Admission, chunked prefill and the pause / evict policy: builds one StepPlan.

Order of service (oldest request first within each class): decode rows, unfinished
prefills, paused requests resuming, then new admissions (only while nothing is paused).
While requests wait for a free place, unfinished prefills leave the step's tokens their
prompts need (at most half the step): a long prompt's chunks never hold admissions back.
A decode row that cannot get a block for its next token is paused (it keeps its blocks).
If a step would otherwise schedule nothing while requests are paused, the newest paused
requests are evicted (blocks released, recomputed later) until the oldest can move, so
the engine always makes progress. Requests with a sample still in flight are scheduled
only from the launch that made it (their input is gathered on the device).

A caller may hold requests (``hold``): they keep their blocks and place but get no row and are
not admitted, as a paused request, without blocking admissions. Holds never leave a step empty:
a step that would schedule nothing under them is scheduled without them."""
from __future__ import annotations

import bisect
from itertools import islice

from megatron_async.config import Scheduling
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.engines.admission_order import admission_order
from megatron_async.inference.engines.request_book import RequestBook
from megatron_async.inference.engines.waiting_queue import WaitingQueue
from megatron_async.inference.request import DynamicInferenceRequest, Status
from megatron_async.inference.step_plan import RowPlan, StepPlan


class Scheduler:
    def __init__(self, config: Scheduling, context: DynamicInferenceContext, book: RequestBook):
        """``book``: the engine's; its speculative policy decides the drafts. Every change of a
        request's state the scheduler decides (queued, released ahead, evicted) goes through it."""
        self.config = config
        self.ctx = context
        self.waiting = WaitingQueue()
        self.num_paused_events = 0
        self.num_evicted_events = 0
        self.prefix_hit_tokens = 0
        self.admissions = 0
        """Requests admitted so far (re-admissions after eviction included)."""
        self.out_of_order = 0
        """Admissions that passed a request queued before (a lower class, or one waiting for a
        shared prompt)."""
        self._prioritized: set[int] = set()
        """Ids of waiting, never admitted requests with a priority other than 0."""
        self.admits_new = True
        """False (``pause_generation("wait")``): only requests admitted before (evicted ones) are
        admitted again, so the running ones can finish."""
        self.spec = book.spec_policy
        self.book = book
        self._by_age: list[DynamicInferenceRequest] = []
        self._by_age_version = -1  # ctx.active_version the list was sorted at
        self.held: frozenset[int] = frozenset()
        """Ids of the requests held (``hold``)."""
        self.held_steps = 0
        """Steps scheduled while requests were held."""

    def hold(self, request_ids) -> None:
        """From the next schedule on, the requests of ``request_ids`` (replacing any held before)
        get no row and are not admitted, unless nothing else could run (ids of requests that are
        not live are ignored)."""
        self.held = frozenset(request_ids)

    def add(self, req: DynamicInferenceRequest) -> None:
        self.book.admit(req)
        req.queued_after = self.admissions
        if req.sampling_params.priority:
            self._prioritized.add(req.request_id)
        self.waiting.append(req)

    def requeue_front(self, req: DynamicInferenceRequest) -> None:
        self.waiting.appendleft(req)

    def remove_waiting(self, req: DynamicInferenceRequest) -> bool:
        """Take ``req`` out of the queue if it waits there (O(1)); whether it did."""
        self._prioritized.discard(req.request_id)
        return self.waiting.discard(req)

    def wants_token(self, req: DynamicInferenceRequest) -> bool:
        """More tokens may be sampled without passing a length limit known on the CPU
        (in-flight drafts counted as accepted)."""
        return self.token_room(req) > 0

    def token_room(self, req: DynamicInferenceRequest) -> int:
        """Tokens the request may still gain beyond the most its in-flight launch brings (the
        length limit less ``tokens_budgeted``, spelled out: this runs for every row every step)."""
        return req.max_generated_tokens - len(req.generated_tokens) - req.num_inflight - req.num_inflight_drafts

    def _spec_decode_rows(self, by_age: list[DynamicInferenceRequest], rows: list[RowPlan], budget: int
                          ) -> tuple[int, list[DynamicInferenceRequest], bool, int]:
        """Step 1 with speculative decoding (``wants_token`` / ``token_room`` spelled out: this runs
        for every row, every step; its first lines repeat ``_plain_decode_rows``'s on purpose, a
        shared helper would cost a call per row). A request decodes when it wants a token and its next row's
        input is its newest token: in flight, or (a row that may carry drafts) bookkept but not
        computed; the rest of its known tokens, if any, are prefilled. Then each decoding request
        gets its row with drafts from the tokens to spare (``_reserve_decode``), or is paused.
        Returns (how many requests decode, unfinished prefills, whether any request is paused,
        drafts in the rows)."""
        decoding, rooms, prefilling, any_paused = [], [], [], False
        active, paused = Status.ACTIVE, Status.PAUSED
        for req in by_age:
            status = req.status
            if status == active:
                generated = len(req.generated_tokens)
                known = len(req.prompt_tokens) + generated
                in_flight = req.num_inflight
                room = req.max_generated_tokens - generated - in_flight - req.num_inflight_drafts
                pending = known - req.num_computed_tokens  # known tokens whose KV is not computed
                if room <= 0:
                    if pending > 0:
                        prefilling.append(req)
                elif pending <= 0:
                    if not (in_flight and req.inflight_row < 0):  # else: a prefill sample in flight
                        decoding.append(req)
                        rooms.append(room)
                elif pending == 1 and not in_flight and generated:
                    decoding.append(req)
                    rooms.append(room)
                else:
                    prefilling.append(req)
            elif status == paused:
                any_paused = True
        spare, n = budget - len(decoding), len(decoding)
        # the most drafts a row may verify in this step (what pays); a step that will carry
        # prefill chunks (unfinished prompts, or admissions) replays a mixed graph only without drafts
        self.spec.plan_step(decoding, bool(prefilling) or self._admission_coming(any_paused))
        drafts_for, ctx, bs = self.spec.drafts_for, self.ctx, self.ctx.block_size
        if self.spec.step_cap == 0:  # a plain step: no row drafts (the policy counts why in one pass)
            self.spec.count_undrafted(decoding, rooms, spare)
            for req in decoding:
                start = req.num_computed_tokens
                if start + 1 > len(req.block_ids) * bs and not ctx.reserve(req, 1):
                    any_paused = self._pause_decode(req)
                else:
                    rows.append(RowPlan(req, start, 1, True, req.inflight_row if req.num_inflight else -1))
            return n, prefilling, any_paused, 0
        for req, room in zip(decoding, rooms):  # _reserve_decode, spelled out
            k = drafts_for(req, n, min(spare, room - 1))
            start = req.num_computed_tokens
            owned = len(req.block_ids) * bs  # positions below it need no reservation
            if k and start + 1 + k > owned and not ctx.reserve(req, 1 + k):
                k = 0
            if k == 0 and start + 1 > owned and not ctx.reserve(req, 1):
                any_paused = self._pause_decode(req)
                continue
            rows.append(RowPlan(req, start, 1 + k, True, req.inflight_row if req.num_inflight else -1, k))
            spare -= k
        return n, prefilling, any_paused, budget - n - spare

    def _pause_decode(self, req: DynamicInferenceRequest) -> bool:
        """A row found no block for its next token (or chunk): the request pauses (keeps its blocks)."""
        self.book.pause(req)
        self.num_paused_events += 1
        return True

    def _plain_decode_rows(self, by_age: list[DynamicInferenceRequest], plan: StepPlan
                           ) -> tuple[list[DynamicInferenceRequest], bool]:
        """Step 1 without speculative decoding, in one pass (it runs for every row, every step,
        so ``wants_token`` / ``_reserve_decode`` are spelled out): a decoding request (wants a
        token, nothing left to prefill but its newest token, no prefill sample in flight) gets a
        one-token row, or is paused when its position starts a block and none is free; a newest
        token landed with nothing launched ahead (serial steps) decodes too, never queued behind
        older prompts' prefill chunks. Deciding each request as the
        pass reaches it equals sorting first: whether a request decodes depends only on its own
        state, and rows reserve blocks in the same (age) order. Returns (unfinished prefills,
        whether any request is paused). The rows' columns go to ``plan.decode_columns``."""
        ctx, bs = self.ctx, self.ctx.block_size
        prefilling, any_paused = [], False
        rows, starts, prevs, slots = plan.rows, [], [], []
        plan.decode_columns = (starts, prevs, slots)
        active, paused = Status.ACTIVE, Status.PAUSED
        for req in by_age:
            status = req.status
            if status == active:
                generated = len(req.generated_tokens)
                known = len(req.prompt_tokens) + generated
                start = req.num_computed_tokens
                if start < known and (start + 1 < known or not generated or req.num_inflight
                                      or req.max_generated_tokens <= generated):
                    prefilling.append(req)
                    continue
                in_flight = req.num_inflight
                if (req.max_generated_tokens - generated <= in_flight + req.num_inflight_drafts
                        or in_flight and req.inflight_row < 0):
                    continue
                if start < len(req.block_ids) * bs or ctx.reserve(req, 1):
                    prev = req.inflight_row if in_flight else -1
                    rows.append(RowPlan(req, start, 1, True, prev))
                    starts.append(start)
                    prevs.append(prev)
                    slots.append(req.decode_slot)
                else:
                    any_paused = self._pause_decode(req)
            elif status == paused:
                any_paused = True
        return prefilling, any_paused

    def _reserve_decode(self, req: DynamicInferenceRequest, num_decode_rows: int, spare: int,
                        room: int | None = None) -> RowPlan | None:
        """KV room for the next decode row, with as many drafts as the policy, the limits and
        ``spare`` step tokens allow (fewer when the pool is short); None: not even one token fits.
        ``room``: ``token_room(req)`` when the caller knows it."""
        room = self.token_room(req) if room is None else room
        k = self.spec.drafts_for(req, num_decode_rows, min(spare, room - 1)) if self.spec.enabled else 0
        start, ctx = req.num_computed_tokens, self.ctx
        owned = len(req.block_ids) * ctx.block_size  # positions below it need no reservation
        if k and start + 1 + k > owned and not ctx.reserve(req, 1 + k):
            k = 0
        if k == 0 and start + 1 > owned and not ctx.reserve(req, 1):
            return None
        return RowPlan(req, start, 1 + k, samples=True, prev_row=req.inflight_row if req.num_inflight else -1,
                       num_drafts=k)

    def schedule(self, has_inflight: bool) -> StepPlan:
        ctx = self.ctx
        if has_inflight:
            self.release_finishing()
        if self.spec.enabled:
            self.spec.begin_step()
        plan = self._plan(self.held)
        if self.held:
            if plan:
                self.held_steps += 1
            else:  # holds never leave a step empty
                plan = self._plan(frozenset())

        # 5. progress guarantee: nothing could move and nothing is in flight, so the pool is
        # held by requests that cannot grow; recompute the newest one later and retry.
        if not plan and not has_inflight and ctx.active:
            victim = max(ctx.active.values(), key=lambda r: r.arrival_order)
            self.book.evict(victim)
            self.num_evicted_events += 1
            self.requeue_front(victim)
            return self.schedule(has_inflight)
        return plan

    def _plan(self, held: frozenset[int]) -> StepPlan:
        """Steps 1-4 of the order of service, the requests of ``held`` left out."""
        plan = StepPlan()
        budget = self.config.max_tokens
        by_age = self._active_by_age()
        if held:
            by_age = [r for r in by_age if r.request_id not in held]

        # 1. decode rows (each one token, plus drafts from the tokens to spare). The same pass
        # collects the unfinished prefills (and recomputes of evicted requests); steps 3 and 4
        # look for paused requests only if any.
        rows = plan.rows
        if not self.spec.enabled:
            prefilling, any_paused = self._plain_decode_rows(by_age, plan)
            num_decoding = len(rows)
        else:
            num_decoding, prefilling, any_paused, drafts = self._spec_decode_rows(by_age, rows, budget)
            budget -= drafts
        budget -= len(rows)
        decode_rows = len(rows)

        # 2. unfinished prefills; no block -> paused. They leave the waiting requests that can be
        # admitted their share of the step, so a long prompt's chunks do not hold them back.
        kept = self._admission_share(budget) if prefilling and not any_paused else 0
        for req in prefilling:
            if budget - kept <= 0:
                break
            used = self._schedule_prefill(req, budget - kept, plan)
            if used == 0 and self._blocked_on_memory(req):
                any_paused = self._pause_decode(req)
            budget -= used

        # 3. resume paused requests whose next token (or chunk) now has room
        for req in by_age if any_paused else ():
            if budget <= 0:
                break
            if req.status != Status.PAUSED or req.num_inflight:
                continue
            if req.is_prefilling:
                used = self._schedule_prefill(req, budget, plan)
                if used:
                    self.book.resume(req)
                    budget -= used
            elif (row := self._reserve_decode(req, num_decoding, budget - 1)) is not None:
                self.book.resume(req)
                plan.rows.append(row)
                budget -= row.num_tokens

        # 4. admissions
        self._admit_waiting(plan, budget, any_paused, held)
        if self.spec.enabled:  # the next step's chunks: a prompt's chunk that does not end it, or admissions
            self.spec.chunks_next = any(not r.samples for r in rows[decode_rows:]) or self._admission_coming(any_paused)
        return plan

    def _admit_waiting(self, plan: StepPlan, budget: int, any_paused: bool, held: frozenset[int]) -> None:
        """Admissions in queue order (by class with priorities: admission_order.py), only while
        nothing is paused; a request whose prompt another is prefilling right now waits for its
        blocks (contexts/prompt_sharing.py), the next ones go on. Without priorities the queue is
        walked from its head only as far as admission goes."""
        ctx, waiting, sharing = self.ctx, self.waiting, self.ctx.sharing
        live = list(waiting) if self._prioritized else None
        order = admission_order(live, self.admissions, self.config.priority_aging) if live is not None else None
        admitted: list[tuple[int, DynamicInferenceRequest]] = []
        for i, req in enumerate(waiting) if order is None else ((i, live[i]) for i in order):
            if not (budget > 0 and len(ctx.active) < self.config.max_requests
                    and not (any_paused and any(r.status == Status.PAUSED for r in ctx.active.values()))):
                break
            if req.num_inflight:
                break  # an evicted request whose last sample has not landed yet
            if not self.admits_new and req.weights_epoch < 0:
                break  # never admitted
            if sharing.enabled and sharing.waits(req) or held and req.request_id in held:
                continue
            hit = self.book.activate(req)
            used = self._schedule_prefill(req, budget, plan)
            if used == 0:
                self.book.evict(req)  # undo the admission: back to waiting, prefix refs dropped
                break
            admitted.append((i, req))
            self.prefix_hit_tokens += hit
            budget -= used
        self._dequeue(admitted)

    def _dequeue(self, admitted: list[tuple[int, DynamicInferenceRequest]]) -> None:
        """Take the ``admitted`` requests (queue index, request; in admission order) off the queue."""
        self.admissions += len(admitted)
        taken: list[int] = []
        for i, req in admitted:
            self.out_of_order += bisect.bisect_left(taken, i) < i  # one queued before it still waits
            bisect.insort(taken, i)
            self.remove_waiting(req)

    def _admission_share(self, budget: int) -> int:
        """Step tokens kept from unfinished prefills for admissions: what the prompts at the head
        of the queue need, as many of them as there are free places, at most half of ``budget``
        (the prefills in progress keep at least the other half). 0 when none can be admitted."""
        if not self._may_admit():
            return 0
        need = 0
        for req in islice(self.waiting, self.config.max_requests - len(self.ctx.active)):
            need += req.num_known_tokens - req.num_computed_tokens
            if need >= budget // 2:
                return budget // 2
        return need

    def _may_admit(self) -> bool:
        """A waiting request may be admitted: new requests are admitted and a place is free."""
        return bool(self.waiting) and self.admits_new and len(self.ctx.active) < self.config.max_requests

    def _admission_coming(self, any_paused: bool) -> bool:
        """A step carries an admission's prefill chunk (a guess for the drafts): one may be
        admitted, nothing is paused and a KV block is free."""
        return not any_paused and self.ctx.allocator.num_available > 0 and self._may_admit()

    def _active_by_age(self) -> list[DynamicInferenceRequest]:
        """The active requests, oldest first; sorted again only when the set changed."""
        if self._by_age_version != self.ctx.active_version:
            self._by_age = sorted(self.ctx.active.values(), key=lambda r: r.arrival_order)
            self._by_age_version = self.ctx.active_version
        return self._by_age

    def release_finishing(self) -> None:
        """Launch-ahead schedules step N+1 before step N is bookkept: requests that N's samples
        finish by length give their places back first, as in serial steps
        (``RequestBook.release_finishing``)."""
        self.book.release_finishing()

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
