"""DynamicInferenceEngine: the waiting queue, ``step()``, serial vs launch-ahead routing.

One launch reads one way: the scheduler plans, the context assembles (``ModelRunner.prepare``),
the request book commits, the runner launches; later the runner collects, the book lands (the
context takes back what finished requests held), and the engine reports a ``StepResult``.

Request lifecycle at the API: ``add_request`` validates and freezes a request (only
``InvalidRequestError`` leaves it); ``step()`` reports every request that gained tokens as a
``RequestUpdate`` and every request that ended as a ``RequestOutput``; ``abort_request`` ends a
request at the next ``step()`` whatever state it is in (its in-flight launch-ahead row is
discarded like a finished request's). A request whose host-side step preparation raises is
failed alone (finish_reason "error") and the engine keeps serving the others.

The engine steps; the rooms beside it admit (admission.py), pause, suspend and switch weights
(generation_control.py), count and log (step_accounting.py), and step it until requests end
(run_to_end.py). The public methods that hand a call to those rooms are engine_controls.py's.

The engine is single-threaded: a server calls add_request / abort_request / step from one
thread (its engine loop), handing requests over through a queue."""
from __future__ import annotations

import logging
import numbers
import time
from typing import TYPE_CHECKING

from megatron_async.config import Scheduling, Speculation
from megatron_async.inference.async_pipeline import PendingLaunch
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.contexts.step_errors import RequestStepError
from megatron_async.inference.engines.admission import Admission
from megatron_async.inference.engines.engine_controls import EngineControls
from megatron_async.inference.engines.engine_stats import EngineStats
from megatron_async.inference.engines.generation_control import GenerationControl
from megatron_async.inference.engines.grammar_masks import GrammarMasks
from megatron_async.inference.engines.lora_control import LoRAControl
from megatron_async.inference.engines.rank_roles import SingleRank, rank_role
from megatron_async.inference.engines.request_book import RequestBook
from megatron_async.inference.engines.request_validation import RequestValidator
from megatron_async.inference.engines.scheduler import Scheduler
from megatron_async.inference.engines.step_accounting import StepAccounting
from megatron_async.inference.engines.step_consensus import NewRequest
from megatron_async.inference.engines.step_result import StepResult
from megatron_async.inference.engines.suspend import MemorySuspender
from megatron_async.inference.engines.weight_receiver import WeightReceiver
from megatron_async.inference.nvtx import nvtx_range
from megatron_async.inference.speculative.policy import SpecPolicy
from megatron_async.inference.step_plan import ALONE, StepAgreement
from megatron_async.inference.request import (
    DynamicInferenceRequest, FinishReason, InvalidRequestError, SamplingParams, Status,
)

if TYPE_CHECKING:  # type-only: the engine depends on contexts, never the reverse, and not at import on controllers
    from megatron_async.inference.communication.zmq_communicator import ZMQCommunicator
    from megatron_async.inference.text_generation_controllers.model_runner import ModelRunner

log = logging.getLogger("megatron_async")


class DynamicInferenceEngine(EngineControls):
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
        self.masks = GrammarMasks(config, tokenizer, runner.eos_ids, runner.model.vocab_size)
        """Structured outputs: requests' grammars and the token masks of their rows."""
        self.book = RequestBook(context, SpecPolicy(speculation))
        self.scheduler = Scheduler(config, context, self.book)
        runner.bind_spec_policy(self.scheduler.spec)
        self.validator = RequestValidator(config, context, runner.model.vocab_size, runner.eos_ids, tokenizer,
                                          routes_experts=runner.routing is not None, grammars=self.masks)
        self.admission = Admission(config, self.validator, self.scheduler, tokenizer)
        self.accounting = StepAccounting(config, context, self.scheduler, self.book, runner, self.masks)
        self._requests: dict[int, DynamicInferenceRequest] = {}  # unfinished, by id
        self._aborts: dict[int, None] = {}  # ids to end at the next step, in call order
        self._held = StepResult()  # produced while generate() ran, handed out by the next step()
        self._pending: PendingLaunch | None = None
        self._launches = 0
        self.ranks = rank_role(communicator) if ranks is None else ranks
        self.ranks.bind(self, config)
        self._quiet: set[int] = set()
        """Ids whose ``RequestUpdate``s nobody reads (``run_requests`` returns whole outputs):
        no update is built for them, so their text is decoded once, when they finish."""
        self.weight_version = 0
        """The version of the model's weights (``set_weight_version``), recorded on every launch."""
        self._pause: str | None = None  # pause_generation's mode while paused
        self.memory = MemorySuspender(getattr(context.device, "suspend_backend", None), context, runner.model)
        """Device memory handed out and taken back by tag (``suspend`` / ``resume``)."""
        self.control = GenerationControl(self)
        self.weights = WeightReceiver(self, config.weight_transfer_timeout_s)
        """Weight updates (``LLM.update_weights``, transfers from a trainer: weight_receiver.py)."""
        self.lora = LoRAControl(self)
        """LoRA adapters: load, unload, update (lora_control.py)."""

    @property
    def stats(self) -> EngineStats:
        """What this engine did (its counting room's ``EngineStats``)."""
        return self.accounting.stats

    @stats.setter
    def stats(self, stats: EngineStats) -> None:
        """A fresh ``EngineStats`` counts from now on (a measured window)."""
        self.accounting.stats = stats

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_tokens: list[int] | str, sampling_params: SamplingParams | None = None,
                    request_id: int | None = None, prompt_digests: bytes = b"") -> int:
        """Queue a request; raises InvalidRequestError (nothing queued) when it can never be served.
        ``request_id``: None (the engine picks) or an id never used in this engine (ids only grow: it must be
        >= every id used so far). ``prompt_digests``: its prompt's block digests as a router computed them."""
        self.ranks.check_can_add()
        try:
            new = self.admission.accept(prompt_tokens, sampling_params, request_id, prompt_digests)
        except InvalidRequestError:
            self.stats.rejected_requests += 1
            raise
        if new.valid.sampling_params.lora is not None:
            self.stats.lora_requests += 1
        self.ranks.accept(new)
        return new.request_id

    def _admit(self, new: NewRequest) -> None:
        req = self.admission.admit(new)
        self.context.adopt_prompt_digests(req, new.digests)  # where rank 0 hashed it to route it
        self._requests[req.request_id] = req

    def _mark_abort(self, request_id: int) -> bool:
        if not isinstance(request_id, numbers.Integral) or request_id not in self._requests or request_id in self._aborts:
            return False
        self._aborts[request_id] = None
        return True

    def _has_local_work(self) -> bool:
        return bool(self._requests) or bool(self._held.finished) or bool(self._held.updates)

    def admission_queue_short(self) -> bool:
        """Whether a caller holding more requests should add them before the next ``step()``
        (``Admission.queue_short``: adding costs the host time a launched step hides). Always
        true under TP / EP, where requests reach every rank at the per-step exchange."""
        return not self.ranks.admits_at_once or self.admission.queue_short()

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
            return self.control.step_paused(out, t0)
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
        self.accounting.wall_time(pending, time.perf_counter() - t0)

    def _launch_slot(self, out: StepResult, first: bool) -> PendingLaunch | None:
        """Schedule and launch one step (``first``: nothing in flight). Where ranks share steps
        they agree on the launch first, and a rank with nothing to launch while others launch
        runs a dummy forward of the agreed size. Alone, a first launch whose request failed is
        scheduled again without it."""
        while True:
            plan = self.scheduler.schedule(has_inflight=not first)
            if first and not plan and self._requests and self._pause is None:  # nothing in flight, nothing admissible: would spin forever
                head = self.scheduler.waiting.head()
                raise RuntimeError(
                    f"engine cannot make progress: {len(self._requests)} unfinished requests, "
                    f"{len(self.context.active)} active, head of queue {head and head.request_id} "
                    f"({head and head.num_known_tokens} tokens) cannot be scheduled"
                )
            agreed = self.ranks.agree_on_launch(plan, out)
            launched = self._try_launch(plan, not first, out, agreed) if plan else None
            if launched is None and agreed.max_tokens > 0:
                self._finish_masks(self._pending)  # the dummy step overwrites the snapshot its sampling reads
                self.runner.dummy_forward(agreed)
                self.stats.dummy_steps += 1
            if launched is not None or not plan or not first or self.ranks.one_launch_per_call:
                break
        if launched is None and not first and self._requests:
            self.accounting.rejected_launch()
        return launched

    def _try_launch(self, plan, overlapped: bool, out: StepResult, agreed: StepAgreement = ALONE
                    ) -> PendingLaunch | None:
        try:
            return self._launch(plan, overlapped, agreed)
        except RequestStepError as e:  # the context undid the plan's host state
            log.error("request %d failed while preparing a step: %s", e.request.request_id, e.message)
            self._end(e.request, FinishReason.ERROR, out, error=e.message)
            return None

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
        self._finish_masks(self._pending)  # the launch in flight samples before this one reads its samples
        launched = runner.launch(step, step_id, overlapped, timed)
        launched.weight_version = self.weight_version
        return launched

    def _finish_masks(self, pending: PendingLaunch | None) -> None:
        """Enqueue the sampling of a launch that awaits its grammar masks (grammar_masks.py), now
        that every launch before it has landed. A request whose grammar refused a landed token
        ends with an error (reported by the next ``step()``); its row is discarded."""
        for req, error in self.masks.finish(self.runner, pending):
            self._end(req, FinishReason.ERROR, self._held, error=error)

    def _bookkeep(self, pending: PendingLaunch, out: StepResult) -> None:
        self._finish_masks(pending)
        samples = self.runner.collect(pending)
        with nvtx_range("update_requests"):
            res = self.book.land(pending, samples)
        self.masks.start(self.runner, self._pending)  # its launch before landed: fill beside the rest of the step
        self.ranks.landed(pending)
        step_time = samples.step_time
        self.accounting.landed(pending, res, step_time)
        for req in res.finished:
            self.scheduler.remove_waiting(req)  # evicted, then finished by its last in-flight sample
            self._report_finished(req, out)
        text, quiet = self.config.stream_text, self._quiet
        if quiet:  # (list comprehensions: every row, every step)
            out.updates += [req.take_update(text) for req in res.updated if req.request_id not in quiet]
        else:
            out.updates += [req.take_update(text) for req in res.updated]
        self.accounting.log_step(pending, step_time)
        out.step_id, out.num_rows, out.is_decode_only = pending.step_id, len(pending.rows), pending.is_decode_only
        out.overlapped, out.step_time = pending.overlapped, step_time

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
        if req.status == Status.WAITING:
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
