"""Data-parallel engines (expert parallelism, attention data parallel): every rank runs its own
engine over its own requests; rank 0 alone accepts requests, routes each to the least loaded
rank and hands back every rank's outputs and updates.

One step = one launch slot on every rank, decided by one exchange (step_consensus.py): each rank
schedules, the ranks agree (anyone launching? the largest token count? graph or eager?), then
each launches its plan or, with nothing to launch while another rank does, a dummy forward of
the agreed size, so the MoE layers' collectives pair up (skipping it deadlocks). Launch-ahead
keeps working: the exchange for step N+1 happens while the device runs step N; the first launch
of a chain is bookkept by the next call (never two launches in one call: the ranks' launch
counts must stay equal). Outputs of rank r reach rank 0 with r's next exchange (rank 0 takes
them at the end of that step, after its launch: the exchange does not wait for them)."""
from __future__ import annotations

import time

from megatron_async.inference.engines.dynamic_engine import DynamicInferenceEngine, StepResult
from megatron_async.inference.engines.step_consensus import StepConsensus
from megatron_async.inference.engines.step_plan import StepAgreement
from megatron_async.inference.nvtx import nvtx_range


class DataParallelEngine(DynamicInferenceEngine):
    def _make_consensus(self, communicator) -> StepConsensus:
        # TP x EP: each data-parallel rank is a TP group whose ranks are replicas (same requests,
        # same steps); only its TP rank 0 hands results up.
        tp_size = self.controller.model.parallel.tp_size
        return StepConsensus(communicator, data_parallel=True, tensor_parallel_size=tp_size)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._sync is None:
            raise ValueError("DataParallelEngine needs a communicator")
        self._outgoing = StepResult()
        """Non-leader ranks: results not yet handed up to rank 0."""

    def _has_local_work(self) -> bool:
        return super()._has_local_work() or self._pending is not None or bool(self._outgoing.finished)

    def _upload(self) -> StepResult | None:
        if self._sync.is_leader or self._sync.tp_rank != 0 or not (self._outgoing.finished or self._outgoing.updates):
            return None
        up, self._outgoing = self._outgoing, StepResult()
        return up

    def has_unfinished_requests(self) -> bool:
        return self._agreed("any_work")

    def _agreed(self, flag: str) -> bool:
        if not self._sync.said(flag):
            self._agree(from_step=False, out=self._held, upload=self._upload())
        return getattr(self._sync.last, flag)

    def _still_waiting(self, want: set[int]) -> bool:
        """Only rank 0 knows which of its requests are still out: every exchange carries its flag."""
        self._leader_waiting = bool(want) and self._sync.is_leader
        return self._agreed("leader_waiting")

    # ------------------------------------------------------------------ stepping
    def step(self) -> StepResult:
        t0 = time.perf_counter()
        out, self._held = self._held, StepResult()
        self._sync.fresh = False
        self._apply_aborts(out)
        first = self._pending is None
        plan = None
        if first or self.config.async_scheduling:
            with nvtx_range("schedule"):
                plan = self.scheduler.schedule(has_inflight=not first)
            if first and not plan and self._requests:
                raise RuntimeError(f"engine cannot make progress: {len(self._requests)} unfinished requests, "
                                   "nothing in flight and nothing can be scheduled")
        ctl = self.controller
        variant = ctl.graphs.replay_variant(plan) if plan and ctl.graphs is not None else None
        eager = bool(plan) and variant is None
        agreed = self._agree(from_step=True, out=out, num_tokens=plan.num_tokens if plan else 0, eager=eager,
                             upload=self._upload(), variant=variant or 0, take_uploads=False)
        step = StepAgreement(agreed.max_tokens, agreed.eager, agreed.variant)
        launched = self._try_launch(plan, not first, out, step) if plan else None
        if launched is None and agreed.max_tokens > 0:
            ctl.dummy_forward(step)
            self.stats.dummy_steps += 1
        if first:
            self._pending = launched
            if launched is None or self.config.async_scheduling:
                return self._finish(out, took_part=agreed.any_work)
        pending, self._pending = self._pending, None
        if not first:
            self._pending = launched
            if launched is None and plan is not None and self._requests:  # launch-ahead found nothing
                self.stats.rejected_launches += 1
                self.stats.rejected_causes[self._rejection_cause()] += 1
        self._land(pending, out, t0)
        return self._finish(out, took_part=True)

    def _finish(self, out: StepResult, took_part: bool) -> StepResult:
        """Rank 0 returns everyone's results (the others', handed up at this step's exchange,
        taken only now: after the launch); the others keep theirs for the next exchange."""
        if took_part and out.step_id < 0:
            out.step_id = 0
        if self._sync.is_leader:
            self._take_uploads(out)
            return out
        if self._sync.tp_rank == 0:  # other TP ranks hold copies of the same results
            self._outgoing.finished.extend(out.finished)
            self._outgoing.updates.extend(out.updates)
        return StepResult(step_id=out.step_id, num_rows=out.num_rows, is_decode_only=out.is_decode_only,
                          overlapped=out.overlapped, step_time=out.step_time)
