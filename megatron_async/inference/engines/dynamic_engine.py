"""DynamicInferenceEngine: the waiting queue, ``step()``, serial vs launch-ahead routing, logging."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_async.config import InferenceConfig
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.engines.async_pipeline import PendingLaunch
from megatron_async.inference.engines.engine_stats import EngineStats
from megatron_async.inference.engines.request_validation import RequestValidator
from megatron_async.inference.engines.scheduler import Scheduler
from megatron_async.inference.engines.tp_sync import TensorParallelSync
from megatron_async.inference.nvtx import nvtx_range
from megatron_async.inference.request import DynamicInferenceRequest, RequestOutput, SamplingParams, Status
if TYPE_CHECKING:  # type-only: the engine depends on contexts, never the reverse, and not at import on controllers
    from megatron_async.inference.communication.zmq_communicator import ZMQCommunicator
    from megatron_async.inference.text_generation_controllers.text_generation_controller import TextGenerationController

log = logging.getLogger("megatron_async")


@dataclass
class StepResult:
    finished: list[RequestOutput] = field(default_factory=list)
    step_id: int = -1
    """Id of the launch bookkept by this call (-1: nothing ran)."""
    num_rows: int = 0
    is_decode_only: bool = False
    overlapped: bool = False
    step_time: float | None = None
    """Device seconds of the bookkept step (logging steps on CUDA; host time on CPU)."""


class DynamicInferenceEngine:
    def __init__(
        self,
        controller: TextGenerationController,
        context: DynamicInferenceContext,
        config: InferenceConfig,
        tokenizer=None,
        communicator: ZMQCommunicator | None = None,
    ):
        """``communicator``: tensor parallelism. Only rank 0 accepts ``add_request``; the other
        ranks receive its requests at each ``step()`` (see tp_sync.py)."""
        self.controller = controller
        self.context = context
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config, context)
        self.validator = RequestValidator(config, context, controller.model.vocab_size, controller.default_eos, tokenizer)
        self.stats = EngineStats()
        self._gen = torch.Generator().manual_seed(config.seed)
        self._next_id = 0
        self._arrivals = 0
        self._requests: dict[int, DynamicInferenceRequest] = {}  # unfinished, by id
        self._pending: PendingLaunch | None = None
        self._launches = 0
        self.time_all_launches = False
        """Time every launch with CUDA events (no host sync; measurement windows only)."""
        self._tp = TensorParallelSync(communicator) if communicator is not None else None

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_tokens: list[int] | str, sampling_params: SamplingParams | None = None,
                    request_id: int | None = None) -> int:
        """Queue a request; raises InvalidRequestError (nothing queued) when it can never be served."""
        if self._tp is not None:
            self._tp.check_can_add()
        return self._add_request(prompt_tokens, sampling_params, request_id)

    def _add_request(self, prompt_tokens: list[int] | str, sampling_params: SamplingParams | None,
                     request_id: int | None) -> int:
        sp = sampling_params or SamplingParams()
        try:
            tokens, stops, eos = self.validator.check(prompt_tokens, sp)
        except ValueError:
            self.stats.rejected_requests += 1
            raise
        rid = self._next_id if request_id is None else request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid} is already in use")
        self._next_id = max(self._next_id, rid + 1)
        seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._gen))
        req = DynamicInferenceRequest(rid, tokens, sp, seed, eos, stops, arrival_order=self._arrivals)
        self._arrivals += 1
        self._requests[rid] = req
        self.scheduler.add(req)
        if self._tp is not None:
            self._tp.record(tokens, sp, rid, seed)
        return rid

    def has_unfinished_requests(self) -> bool:
        """Under TP a collective: every rank gets the same answer (and must call it together)."""
        if self._tp is not None:
            return self._tp.any_rank(bool(self._requests))
        return bool(self._requests)

    # ------------------------------------------------------------------ stepping
    def step(self) -> StepResult:
        """Bookkeep one launch (launching the next one first in async mode)."""
        t0 = time.perf_counter()
        if self._tp is not None:  # collective: the other ranks add rank 0's new requests
            for new in self._tp.exchange():
                self._add_request(new.prompt_tokens, new.sampling_params, new.request_id)
        with nvtx_range("schedule"):
            if self._pending is None:
                plan = self.scheduler.schedule(has_inflight=False)
                if not plan:
                    if self._requests:  # nothing in flight, nothing admissible: would spin forever
                        head = self.scheduler.waiting[0] if self.scheduler.waiting else None
                        raise RuntimeError(
                            f"engine cannot make progress: {len(self._requests)} unfinished requests, "
                            f"{len(self.context.active)} active, head of queue {head and head.request_id} "
                            f"({head and head.num_known_tokens} tokens) cannot be scheduled"
                        )
                    return StepResult()
                self._pending = self._launch(plan, overlapped=False)
            nxt = None
            if self.config.async_scheduling:
                with nvtx_range("launch_ahead"):
                    nxt = self._launch_ahead()
        pending, self._pending = self._pending, nxt
        with nvtx_range("reconcile"):
            result = self._bookkeep(pending)
            if self._pending is not None and not self._requests:
                # Every row of the launch-ahead step belonged to requests that just finished:
                # land it now so no launch outlives the work (its rows are all discarded).
                with nvtx_range("drain"):
                    self._bookkeep(self._pending)
                self._pending = None
        self._account_time(pending, time.perf_counter() - t0)
        return result

    def _launch_ahead(self) -> PendingLaunch | None:
        plan = self.scheduler.schedule(has_inflight=True)
        if plan:
            return self._launch(plan, overlapped=True)
        if self._requests:
            self.stats.rejected_launches += 1
            self.stats.rejected_causes[self._rejection_cause()] += 1
            self.stats.drains += 1
        return None

    def _rejection_cause(self) -> str:
        active = list(self.context.active.values())
        if any(r.status == Status.PAUSED for r in active):
            return "paused"
        if active and all(not self.scheduler.wants_token(r) for r in active if not r.is_prefilling):
            return "length_limit"
        if self.scheduler.waiting:
            return "admission_blocked"
        return "other"

    def _launch(self, plan, overlapped: bool) -> PendingLaunch:
        self._launches += 1
        interval = self.config.logging_step_interval
        timed = self.time_all_launches or (interval > 0 and self._launches % interval == 0)
        self.stats.overlapped_steps += overlapped
        return self.controller.launch_step(plan, self._launches, overlapped, timed)

    def _bookkeep(self, pending: PendingLaunch) -> StepResult:
        res = self.controller.bookkeep_step(pending)
        st = self.stats
        st.steps += 1
        st.discarded_rows += res.num_discarded
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
            st.prefill_tokens += sum(r.num_tokens for r in pending.rows if r.num_tokens > 1 or not r.is_decode)
        st.generated_tokens += sum(1 for r in pending.rows if r.samples) - res.num_discarded
        outputs = []
        for req in res.finished:
            if req in self.scheduler.waiting:  # evicted, then finished by its last in-flight sample
                self.scheduler.remove_waiting(req)
            self._requests.pop(req.request_id, None)
            st.finished_requests += 1
            outputs.append(req.to_output(self._detokenize(req.generated_tokens)))
        if res.step_time is not None and pending.timing_events:
            st.timed_steps += 1
            st.timed_device_time += res.step_time
        if self.config.logging_step_interval and pending.step_id % self.config.logging_step_interval == 0:
            self._log(pending, res.step_time)
        return StepResult(outputs, pending.step_id, len(pending.rows), pending.is_decode_only, pending.overlapped, res.step_time)

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

    def _detokenize(self, tokens: list[int]) -> str | None:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else None

    def run_until_done(self) -> list[RequestOutput]:
        outs = []
        while self.has_unfinished_requests():
            outs.extend(self.step().finished)
        return outs
