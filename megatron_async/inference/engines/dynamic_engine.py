"""DynamicInferenceEngine: the waiting queue, ``step()``, serial vs launch-ahead routing, logging.

One launch reads one way: the scheduler plans, the context assembles (``ModelRunner.prepare``),
the request book commits, the runner launches; later the runner collects, the book lands (the
context takes back what finished requests held), and the engine reports a ``StepResult``.

Request lifecycle at the API: ``add_request`` validates and freezes a request (only
``InvalidRequestError`` leaves it); ``step()`` reports every request that gained tokens as a
``RequestUpdate`` and every request that ended as a ``RequestOutput``; ``abort_request`` ends a
request at the next ``step()`` whatever state it is in (its in-flight launch-ahead row is
discarded like a finished request's). A request whose host-side step preparation raises is
failed alone (finish_reason "error") and the engine keeps serving the others.

The engine is single-threaded: a server calls add_request / abort_request / step from one
thread (its engine loop), handing requests over through a queue."""
from __future__ import annotations

import logging
import numbers
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from megatron_async.config import Scheduling, Speculation
from megatron_async.inference import triton_builds
from megatron_async.inference.async_pipeline import PendingLaunch
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.contexts.step_errors import RequestStepError
from megatron_async.inference.engines.engine_stats import EngineStats
from megatron_async.inference.engines.rank_roles import SingleRank, rank_role
from megatron_async.inference.engines.request_book import RequestBook
from megatron_async.inference.engines.request_validation import RequestValidator, ValidRequest
from megatron_async.inference.engines.scheduler import Scheduler
from megatron_async.inference.engines.step_consensus import NewRequest
from megatron_async.inference.engines.step_result import StepResult
from megatron_async.inference.engines.suspend import MemorySuspender, SuspendError
from megatron_async.inference.nvtx import nvtx_range
from megatron_async.inference.speculative.policy import SpecPolicy
from megatron_async.inference.step_plan import ALONE, StepAgreement, StepPlan
from megatron_async.inference.request import (
    DynamicInferenceRequest, FinishReason, InvalidRequestError, RequestOutput, SamplingParams, Status,
)
from megatron_async.inference.text_stream import TextStream

if TYPE_CHECKING:  # type-only: the engine depends on contexts, never the reverse, and not at import on controllers
    from megatron_async.inference.communication.zmq_communicator import ZMQCommunicator
    from megatron_async.inference.text_generation_controllers.model_runner import ModelRunner

log = logging.getLogger("megatron_async")


class DynamicInferenceEngine:
    def __init__(
        self,
        runner: ModelRunner,
        context: DynamicInferenceContext,
        config: Scheduling,
        speculation: Speculation,
        tokenizer=None,
        communicator: ZMQCommunicator | None = None,
        ranks: SingleRank | None = None,
    ):
        """``ranks``: how this rank shares steps with others (rank_roles.py: alone, tensor-parallel
        replicas or data-parallel ranks); None: tensor-parallel replicas over ``communicator``
        if one is given, else alone. ``runner``: the model runner. ``speculation``: the one
        speculative policy's settings (the scheduler drafts by it, the book and runner read it)."""
        self.runner = runner
        self.context = context
        self.config = config
        self.async_scheduling = config.async_scheduling
        """Launch-ahead on (read at every step: a test may switch one engine between modes)."""
        self.tokenizer = tokenizer
        self.book = RequestBook(context, SpecPolicy(speculation))
        self.scheduler = Scheduler(config, context, self.book)
        runner.bind_spec_policy(self.scheduler.spec)
        self.validator = RequestValidator(config, context, runner.model.vocab_size, runner.eos_ids, tokenizer,
                                          routes_experts=runner.routing is not None)
        self.stats = EngineStats()
        self._gen = torch.Generator().manual_seed(config.seed)
        self._next_id = 0
        self._arrivals = 0
        self._requests: dict[int, DynamicInferenceRequest] = {}  # unfinished, by id
        self._aborts: dict[int, None] = {}  # ids to end at the next step, in call order
        self._held = StepResult()  # produced while generate() ran, handed out by the next step()
        self._pending: PendingLaunch | None = None
        self._launches = 0
        self.ranks = rank_role(communicator) if ranks is None else ranks
        self.ranks.bind(self)
        self._quiet: set[int] = set()
        """Ids whose ``RequestUpdate``s nobody reads (``run_requests`` returns whole outputs):
        no update is built for them, so their text is decoded once, when they finish."""
        self._builds_at_warmup: int | None = None  # the process's Triton build count after warm-up
        self.weight_version = 0
        """The version of the model's weights (``set_weight_version``), recorded on every launch."""
        self._pause: str | None = None  # pause_generation's mode while paused
        self.memory = MemorySuspender(getattr(context.device, "suspend_backend", None), context, runner.model)
        """Device memory handed out and taken back by tag (``suspend`` / ``resume``)."""

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_tokens: list[int] | str, sampling_params: SamplingParams | None = None,
                    request_id: int | None = None) -> int:
        """Queue a request; raises InvalidRequestError (nothing queued) when it can never be
        served. ``request_id``: None (the engine picks) or an id never used in this engine
        (ids only grow: it must be >= every id used so far)."""
        self.ranks.check_can_add()
        new = self._accept(prompt_tokens, sampling_params, request_id)
        self.ranks.accept(new)
        return new.request_id

    def _accept(self, prompt_tokens, sampling_params, request_id) -> NewRequest:
        """Validate, and give the request its id and seed."""
        try:
            valid = self.validator.check(prompt_tokens, SamplingParams() if sampling_params is None else sampling_params)
            rid = self._check_id(request_id)
        except InvalidRequestError:
            self.stats.rejected_requests += 1
            raise
        self._next_id = rid + 1
        sp = valid.sampling_params
        seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._gen))
        return NewRequest(valid, rid, seed)

    def _admit(self, new: NewRequest) -> None:
        valid, rid = new.valid, new.request_id
        self._next_id = max(self._next_id, rid + 1)
        req = DynamicInferenceRequest(rid, valid.prompt_tokens, valid.sampling_params, new.seed, valid.eos_ids,
                                      valid.stop_sequences, arrival_order=self._arrivals, text=self._text_stream(valid))
        self._arrivals += 1
        self._requests[rid] = req
        self.scheduler.add(req)

    def _check_id(self, request_id) -> int:
        if request_id is None:
            return self._next_id
        if isinstance(request_id, bool) or not isinstance(request_id, numbers.Integral) or request_id < 0:
            raise InvalidRequestError(f"request_id must be a non-negative integer or None, got {request_id!r}")
        if request_id < self._next_id:
            raise InvalidRequestError(
                f"request id {request_id} is already in use or was used before (ids are never reused: "
                f"give None or an id >= {self._next_id})")
        return int(request_id)

    def _text_stream(self, valid: ValidRequest) -> TextStream | None:
        if self.tokenizer is None:
            return None
        sp = valid.sampling_params
        return TextStream(self.tokenizer, valid.prompt_tokens, valid.stop_strings, sp.skip_special_tokens,
                          sp.include_stop_str_in_output)

    def abort_request(self, request_id: int) -> bool:
        """End an unfinished request at the next ``step()``: its output comes in that step's
        ``finished`` with finish_reason "abort", its KV blocks and state slot are freed.
        Returns False (and does nothing) for an unknown, finished or already aborted id."""
        return self.ranks.abort(request_id)

    def _mark_abort(self, request_id: int) -> bool:
        if not isinstance(request_id, numbers.Integral) or request_id not in self._requests or request_id in self._aborts:
            return False
        self._aborts[request_id] = None
        return True

    def _has_local_work(self) -> bool:
        return bool(self._requests) or bool(self._held.finished) or bool(self._held.updates)

    def admission_queue_short(self) -> bool:
        """Whether a caller holding more requests should add them before the next ``step()``.

        Validating and adding requests costs the host ~0.2 ms per 1,000 prompt tokens (13.6 ms
        for workload A's 128 prompts), GPU idle if done before the first step. A caller that adds while
        this is true and steps otherwise (``LLM.generate``, the benchmark driver) validates the
        rest while the GPU runs the steps already launched. The next step admits at most
        ``max_requests`` requests and ``max_tokens`` tokens, so a queue holding either (twice the
        tokens, for prefix hits that shorten chunks) loses no admission. Always true under TP /
        EP, where requests reach every rank at the per-step exchange."""
        if not self.ranks.admits_at_once:
            return True
        waiting = self.scheduler.waiting
        if len(waiting) >= self.config.max_requests:
            return False
        return sum(r.num_known_tokens - r.num_computed_tokens for r in waiting) < 2 * self.config.max_tokens

    def has_unfinished_requests(self) -> bool:
        """Requests not yet reported finished. Under TP / EP a collective: every rank gets the
        same answer (and must call it together). It reuses the latest per-step agreement while
        that said "work" (a stale yes costs at most one empty step), else exchanges afresh."""
        return self.ranks.has_unfinished_requests()

    # ------------------------------------------------------------------ warm-up
    def warmup(self):
        """Build every Triton kernel variant and capture every CUDA graph this engine can use,
        so serving never compiles or captures (``LLM`` calls it at build on CUDA unless
        ``InferenceConfig.startup_warmup`` is off). Call with nothing in flight. Returns the
        runner's ``WarmupReport``; the stats' ``warmup_*`` fields hold it too."""
        if self._pending is not None:
            raise RuntimeError("engine.warmup() needs an idle engine: a launch is in flight")
        report = self.runner.warmup()
        st = self.stats
        st.warmup_seconds += report.seconds
        st.warmup_memory_bytes += report.memory_bytes
        st.warmup_graphs += report.graphs_captured
        st.warmup_triton_builds += report.triton_builds
        self._builds_at_warmup = triton_builds.builds()
        return report

    def _count_graph_use(self) -> None:
        graphs, st = self.runner.graphs, self.stats
        if graphs is not None:
            st.graph_replays, st.mixed_graph_replays = graphs.num_replays, graphs.num_mixed_replays
            st.spec_graph_replays = graphs.num_verify_replays
            st.graph_captures_after_warmup = graphs.captures_after_warmup if graphs.warmed_up else len(graphs.graphs)
        if self._builds_at_warmup is not None:
            st.triton_builds_after_warmup = triton_builds.builds() - self._builds_at_warmup

    # ------------------------------------------------------------------ stepping
    def step(self) -> StepResult:
        """Bookkeep one launch (launching the next one first in async mode). Ranks that share
        steps agree on each launch through ``self.ranks``; data-parallel ranks launch once per
        call, so a chain's first launch is bookkept by the next call."""
        t0 = time.perf_counter()
        out, ranks = self._held, self.ranks
        ranks.open_step(out)
        if self._pause in (None, "wait"):  # every rank alike: no rank generates while one is suspended
            ranks.check_can_generate()  # raises with ``out`` still held and nothing changed
        self._held = StepResult()
        self._apply_aborts(out)
        if self._pause is not None and self._pause != "wait":
            return self._step_paused(out, t0)
        if self._pending is None:
            with nvtx_range("schedule"):
                self._pending = self._launch_slot(out, first=True)
            if self._pending is None:
                self.stats.paused_steps += self._pause is not None
                return ranks.close_step(out, landed=False)
            if self.async_scheduling and ranks.one_launch_per_call:
                return ranks.close_step(out, landed=False)
        nxt = None
        if self.async_scheduling:
            with nvtx_range("launch_ahead"):
                nxt = self._launch_slot(out, first=False)
        pending, self._pending = self._pending, nxt
        self._land(pending, out, t0)
        return ranks.close_step(out, landed=True)

    def _land(self, pending: PendingLaunch, out: StepResult, t0: float) -> None:
        """Bookkeep ``pending`` (the launch ahead of it, if any, is ``self._pending``)."""
        with nvtx_range("reconcile"):
            self._bookkeep(pending, out)
            if self._pending is not None and not self._requests:
                # Every row of the launch-ahead step belonged to requests that just finished:
                # land it now so no launch outlives the work (its rows are all discarded).
                with nvtx_range("drain"):
                    self._bookkeep(self._pending, out)
                self._pending = None
        if self._pending is None and self._requests:
            self.stats.drains += 1  # the device idles until the host launches again
        self._account_time(pending, time.perf_counter() - t0)

    def _launch_slot(self, out: StepResult, first: bool) -> PendingLaunch | None:
        """Schedule and launch one step (``first``: nothing in flight). Where ranks share steps
        they agree on the launch first, and a rank with nothing to launch while others launch
        runs a dummy forward of the agreed size. Alone, a first launch whose request failed is
        scheduled again without it."""
        while True:
            plan = self.scheduler.schedule(has_inflight=not first)
            if first and not plan and self._requests and self._pause is None:  # nothing in flight, nothing admissible: would spin forever
                head = self.scheduler.waiting[0] if self.scheduler.waiting else None
                raise RuntimeError(
                    f"engine cannot make progress: {len(self._requests)} unfinished requests, "
                    f"{len(self.context.active)} active, head of queue {head and head.request_id} "
                    f"({head and head.num_known_tokens} tokens) cannot be scheduled"
                )
            agreed = self.ranks.agree_on_launch(plan, out)
            launched = self._try_launch(plan, not first, out, agreed) if plan else None
            if launched is None and agreed.max_tokens > 0:
                self.runner.dummy_forward(agreed)
                self.stats.dummy_steps += 1
            if launched is not None or not plan or not first or self.ranks.one_launch_per_call:
                break
        if launched is None and not first and self._requests:
            self.stats.rejected_launches += 1
            self.stats.rejected_causes[self._rejection_cause()] += 1
        return launched

    def _try_launch(self, plan, overlapped: bool, out: StepResult, agreed: StepAgreement = ALONE
                    ) -> PendingLaunch | None:
        try:
            return self._launch(plan, overlapped, agreed)
        except RequestStepError as e:  # the context undid the plan's host state
            log.error("request %d failed while preparing a step: %s", e.request.request_id, e.message)
            self._end(e.request, FinishReason.ERROR, out, error=e.message)
            return None

    def _rejection_cause(self) -> str:
        active = list(self.context.active.values())
        if any(r.status == Status.PAUSED for r in active):
            return "paused"
        if not active and self.scheduler.waiting:
            return "admission_blocked"
        # every remaining row at its limit (those released ahead have left ``active`` already)
        if all(not self.scheduler.wants_token(r) for r in active if not r.is_prefilling):
            return "length_limit"
        if self.scheduler.waiting:
            return "admission_blocked"
        return "other"

    def _launch(self, plan, overlapped: bool, agreed: StepAgreement) -> PendingLaunch:
        step_id = self._launches + 1
        interval = self.config.logging_step_interval
        timed = interval > 0 and step_id % interval == 0
        launched = self.launch_plan(plan, step_id, overlapped, timed, agreed)
        self._launches = step_id
        self.stats.overlapped_steps += overlapped
        return launched

    def launch_plan(self, plan, step_id: int, overlapped: bool, timed: bool, agreed: StepAgreement = ALONE
                    ) -> PendingLaunch:
        """One launch: the context assembles ``plan`` (RequestStepError: nothing changed), the
        book commits it, the runner launches it. ``agreed``: data-parallel ranks' agreement on
        the step. (Tools that trace launches wrap this.)"""
        runner = self.runner
        step = runner.prepare(plan, agreed)
        self.book.commit(plan, step.speculative if runner.spec_steps is not None else None)
        launched = runner.launch(step, step_id, overlapped, timed)
        launched.weight_version = self.weight_version
        return launched

    # ------------------------------------------------------------------ weights and pausing
    def set_weight_version(self, version: int, recompute_kv: bool = True) -> None:
        """The model's weights were updated in place (``LLM.update_weights``): launches from now
        on record ``version`` on their tokens (a launch enqueued before ran on the old weights:
        same stream), and KV / Mamba states cached before are never hit again. ``recompute_kv``:
        the launch in flight lands now (its results come with the next ``step()``) and every
        request holding KV gives it back and recomputes it with the new weights (prompt and tokens
        so far, as after an eviction) before its next token; False: they keep the old weights' KV."""
        if recompute_kv:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._land(pending, self._held, time.perf_counter())
            for req in sorted(self.context.active.values(), key=lambda r: r.arrival_order, reverse=True):
                self.book.evict(req)  # the oldest ends first in the queue
                self.scheduler.requeue_front(req)
                self.stats.recomputed_after_update += 1
        self.weight_version = version
        self.context.weights_changed()
        self.memory.weights_updated()

    @property
    def is_paused(self) -> bool:
        """Generation is paused on this rank (under TP / EP the same on every rank between steps)."""
        return self._pause is not None

    def pause_generation(self, mode: str = "keep") -> None:
        """Stop generating until ``resume_generation``. ``"abort"``: every unfinished request
        ends with finish_reason "abort" (outputs in the next ``step()``); ``"wait"``: no new
        admissions, running requests (evicted ones too) run to their end; ``"keep"``: the
        in-flight launch lands at the next ``step()``, then nothing runs; requests keep their KV
        and continue, token-identically, after resuming. While paused ``add_request`` still
        queues, and a ``step()`` with nothing to land does no device work and returns an empty
        result (``EngineStats.paused_steps``).

        Under TP / EP only rank 0 calls it; every rank applies it at the same per-step exchange
        (the next ``step()``'s, or an idle check's), and ``is_paused`` turns True on every rank
        there; what is in flight has landed when the ``step()`` after that returns."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"unknown pause mode {mode!r}: use 'abort', 'wait' or 'keep'")
        if mode == "wait":  # running requests would step on suspended memory
            self.memory.check_can_generate()
        self.ranks.pause(mode)

    def resume_generation(self) -> None:
        """Generate again after ``pause_generation`` (no-op when not paused). Under TP / EP, as
        ``pause_generation``: rank 0 calls it, every rank applies it at the next exchange; while
        any rank's memory is still suspended, every rank's ``step()`` raises ``SuspendError``."""
        self.memory.check_can_generate()
        self.ranks.pause(None)

    def _set_pause(self, mode: str | None) -> None:
        self._pause = mode
        self.scheduler.admits_new = mode != "wait"

    def suspend(self, tags=("weights", "kv_cache"), keep_weights_on_host: bool = True) -> None:
        """Free device memory by tag ("weights": the parameters; "kv_cache": the KV pool, the
        Mamba state pools and the CUDA graph pools) for a colocated trainer; needs
        ``InferenceConfig.enable_suspend`` and ``pause_generation("keep")`` (or "abort") with the
        in-flight launch landed. Running requests keep their KV (copied to host memory) and
        continue token-identically after ``resume``. ``keep_weights_on_host=False`` drops the
        weights: refill them with ``update_weights`` after ``resume(("weights",))`` and before
        ``resume(("kv_cache",))``. Wrong orders raise ``SuspendError`` and change nothing
        (engines/suspend.py). Under TP / EP every rank calls it (and ``resume``), like
        ``update_weights``: each frees its own memory, once ``is_paused`` and the step after it
        landed the in-flight launch there; paused exchanges are host-only."""
        self.memory.check_enabled()
        if self._pause not in ("keep", "abort"):
            raise SuspendError("suspend while generating: pause_generation('keep') first")
        if self._pending is not None:
            raise SuspendError("a launch is in flight: step() once after pause_generation to land it, then suspend")
        self.memory.suspend(tags, keep_weights_on_host)

    def resume(self, tags=("weights", "kv_cache")) -> None:
        """Give back the device memory of ``tags`` freed by ``suspend`` (same addresses: captured
        graphs replay as before); then ``resume_generation()``."""
        self.memory.resume(tags)

    def _step_paused(self, out: StepResult, t0: float) -> StepResult:
        """``step()`` paused ("keep" / "abort"): the in-flight launch lands, nothing launches.
        Data-parallel ranks still exchange (all of them are paused: nobody forwards), so rank 0's
        resume, requests and aborts reach them and their results reach rank 0."""
        pending, self._pending = self._pending, None
        if pending is None:
            self.stats.paused_steps += 1
        else:
            self._land(pending, out, t0)
        self.ranks.agree_on_launch(StepPlan(), out)
        return self.ranks.close_step(out, landed=pending is not None)

    # ------------------------------------------------------------------ endings
    def _apply_aborts(self, out: StepResult) -> None:
        aborts, self._aborts = self._aborts, {}
        for rid in aborts:
            req = self._requests.get(rid)
            if req is not None:
                self._end(req, FinishReason.ABORT, out)

    def _end(self, req: DynamicInferenceRequest, reason: FinishReason, out: StepResult, error: str | None = None) -> None:
        """End a request outside normal bookkeeping (abort, failure), in any state. A row it
        has in flight is discarded when that launch lands (reconcile: it is FINISHED)."""
        if req.status == Status.WAITING and req in self.scheduler.waiting:
            self.scheduler.remove_waiting(req)
        self.book.finish(req, reason, error)  # blocks and state slot back (nothing held while waiting)
        if reason == FinishReason.ABORT:
            self.stats.aborted_requests += 1
        else:
            self.stats.failed_requests += 1
        self._report_finished(req, out)
        out.updates.append(req.take_update(self.config.stream_text))

    def _report_finished(self, req: DynamicInferenceRequest, out: StepResult) -> None:
        self._requests.pop(req.request_id, None)
        self.ranks.forget(req.request_id)
        if req.text is not None:
            req.text.finish()
        out.finished.append(req.to_output())

    def _bookkeep(self, pending: PendingLaunch, out: StepResult) -> None:
        samples = self.runner.collect(pending)
        with nvtx_range("update_requests"):
            res = self.book.land(pending, samples)
        self.ranks.landed(pending)
        st = self.stats
        st.steps += 1
        st.discarded_rows += res.num_discarded
        st.fast_decode_snapshots = self.context.fast_decode_snapshots
        st.fast_landings = self.book.fast_landings
        self._count_graph_use()
        st.paused = self.scheduler.num_paused_events
        st.evicted = self.scheduler.num_evicted_events
        st.prefix_hit_tokens = self.scheduler.prefix_hit_tokens
        cache = self.context.mamba.prefix_cache if self.context.mamba is not None else None
        if cache is not None:
            st.mamba_states_stored, st.mamba_states_restored, st.mamba_states_evicted = cache.stored, cache.restored, cache.evicted
        if pending.is_decode_only:
            st.decode_steps += 1
            st.overlapped_decode_steps += pending.overlapped
        else:
            st.prefill_steps += 1
            st.prefill_tokens += sum(r.num_tokens for r in pending.rows if r.num_tokens > 1 + r.num_drafts or not r.is_decode)
        st.generated_tokens += res.num_tokens
        if res.drafted is not None:
            self._count_speculation(res)
        for req in res.finished:
            if req in self.scheduler.waiting:  # evicted, then finished by its last in-flight sample
                self.scheduler.remove_waiting(req)
            st.finished_requests += 1
            self._report_finished(req, out)
        text, quiet = self.config.stream_text, self._quiet
        out.updates.extend(req.take_update(text) for req in res.updated if req.request_id not in quiet)
        step_time = samples.step_time
        if step_time is not None and pending.timing_events:
            st.timed_steps += 1
            st.timed_device_time += step_time
        if self.config.logging_step_interval and pending.step_id % self.config.logging_step_interval == 0:
            self._log(pending, step_time)
        out.step_id, out.num_rows, out.is_decode_only = pending.step_id, len(pending.rows), pending.is_decode_only
        out.overlapped, out.step_time = pending.overlapped, step_time

    def _count_speculation(self, res) -> None:
        st = self.stats
        if not st.spec_draft_tokens_per_depth:
            st.spec_draft_tokens_per_depth = [0] * len(res.drafted)
            st.spec_accepted_tokens_per_depth = [0] * len(res.accepted)
        for d, (n, a) in enumerate(zip(res.drafted, res.accepted)):
            st.spec_draft_tokens_per_depth[d] += n
            st.spec_accepted_tokens_per_depth[d] += a
        st.spec_draft_tokens += sum(res.drafted)
        st.spec_accepted_tokens += sum(res.accepted)
        st.spec_verify_rows += res.drafted[0] if res.drafted else 0
        st.spec_truncated_rows += res.truncated
        st.spec_off_rows = Counter(self.scheduler.spec.off_rows)
        st.spec_plain_steps = self.runner.spec_steps.plain_steps

    def _account_time(self, pending: PendingLaunch, wall: float) -> None:
        if pending.is_decode_only:
            self.stats.decode_wall_time += wall
        else:
            self.stats.prefill_wall_time += wall

    def _log(self, pending: PendingLaunch, step_time: float | None) -> None:
        st = self.stats
        t = f"{1e3 * step_time:.2f} ms" if step_time is not None else "n/a"
        log.info(
            "step %d: rows=%d tokens=%d %s device=%s | active=%d waiting=%d free_blocks=%d | overlapped=%d/%d paused=%d evicted=%d",
            pending.step_id, len(pending.rows), pending.num_tokens, "decode" if pending.is_decode_only else "mixed", t,
            len(self.context.active), len(self.scheduler.waiting), self.context.allocator.num_available,
            st.overlapped_decode_steps, st.decode_steps, st.paused, st.evicted,
        )

    def run_until_done(self) -> list[RequestOutput]:
        outs = []
        while self.has_unfinished_requests():
            res = self.step()
            self._check_not_stuck(res)
            outs.extend(res.finished)
        return outs

    def _check_not_stuck(self, res: StepResult) -> None:
        """A loop stepping until requests finish would wait forever on a paused engine."""
        if self._pause is not None and res.step_id == -1 and not res.finished and not res.updates:
            raise RuntimeError("generation is paused and nothing can run: resume_generation() first")

    def run_requests(self, request_ids: list[int],
                     feed: Callable[[], tuple[list[int], bool]] | None = None) -> dict[int, RequestOutput]:
        """Step until these requests finish and return their outputs. Outputs and updates of
        other requests produced meanwhile are not lost: the next ``step()`` returns them.
        ``feed`` (single-rank engines): called before every step, it adds requests and returns
        (their ids, whether it holds more); their outputs are returned too."""
        if self._pause is not None and request_ids:  # (the same answer on every rank: applied at one exchange)
            raise RuntimeError("generation is paused: new requests cannot run until resume_generation()")
        own, want, got = set(request_ids), set(request_ids), {}
        self._quiet |= own  # their updates would be dropped below: do not build them
        more = feed is not None
        try:
            while True:
                if more:
                    new, more = feed()
                    own.update(new)
                    want.update(new)
                    self._quiet.update(new)
                if not self.ranks.still_waiting(want):
                    if more:
                        continue
                    break
                res = self.step()
                self._check_not_stuck(res)
                for o in res.finished:
                    if o.request_id in own:
                        got[o.request_id] = o
                        want.discard(o.request_id)
                    else:
                        self._held.finished.append(o)
                self._held.updates.extend(u for u in res.updates if u.request_id not in own)
        finally:
            self._quiet -= own
        self.ranks.leader_waiting = False
        return got
