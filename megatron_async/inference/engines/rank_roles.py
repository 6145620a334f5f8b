"""How the ranks serving one model share ``DynamicInferenceEngine.step()``: the engine has one
step body and is given one of these roles, which answers what differs between

- ``SingleRank``: one engine alone. Requests are admitted at once; nothing is exchanged.
- ``TensorParallelReplicas``: every rank runs the same steps over the same requests. Only rank 0
  accepts ``add_request`` / ``abort_request``; every rank admits them at the one per-step
  exchange (step_consensus.py), which sits at the start of ``step()``, before scheduling, so
  identical bookkeeping yields identical batches and graph choices.
- ``DataParallelRanks`` (expert parallelism, attention data parallel): every rank runs its own
  requests; rank 0 routes each new one to a rank by ``InferenceConfig.dp_routing`` (load and
  prefix affinity, rank_router.py: the other ranks report what their caches reclaimed with their
  results) and returns every rank's outputs. Each rank schedules first, then the exchange agrees
  on the launch (anyone launching? the largest token count? graph or eager? which sampling
  variant?), and a rank with nothing to launch while others launch runs a dummy forward of the
  agreed size, so the MoE collectives pair up. One launch per call (the ranks' launch counts
  stay equal): the first launch of a chain is bookkept by the next call. Under launch-ahead the
  exchange for step N+1 runs while the device runs step N. Rank r's results reach rank 0 with
  r's next exchange; rank 0 takes them at the end of that step, after its launch.

``pause_generation`` / ``resume_generation``: alone, at once; where ranks share steps, rank 0's
call rides every exchange (``Agreement.pause``) and every rank applies it at the same one, so all
stop and resume launching at the same step ("abort" sends an abort for every live request too).
Each rank suspends its own memory, so every exchange also carries whether a rank's memory is
suspended (``Agreement.blocked``): a step that would generate while any rank is suspended raises
the same ``SuspendError`` on every rank before any launch (``check_can_generate``).

A role reads the engine it is bound to (its requests, the launch in flight, its stats) and
changes the engine's requests only through the engine's own ``_admit``, ``_mark_abort`` and
``_set_pause``."""
from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

from megatron_async.inference.async_pipeline import PendingLaunch
from megatron_async.inference.engines.rank_router import RankRouter, routes_by_prefix, take_evicted
from megatron_async.inference.engines.step_consensus import PAUSE_MODES, Agreement, NewRequest, StepConsensus
from megatron_async.inference.engines.step_records import Upload
from megatron_async.inference.engines.step_result import StepResult
from megatron_async.inference.engines.suspend import check_ranks_can_generate
from megatron_async.inference.nvtx import nvtx_range
from megatron_async.inference.step_plan import ALONE, StepAgreement, StepPlan

if TYPE_CHECKING:
    from megatron_async.config import Scheduling
    from megatron_async.inference.communication.zmq_communicator import ZMQCommunicator

_DIGEST_MOD = (1 << 61) - 1  # a Mersenne prime: digests stay small ints for the max-reduce


class SingleRank:
    consensus: StepConsensus | None = None
    admits_at_once = True
    """``add_request`` admits into this engine's queue (else at the next exchange)."""
    one_launch_per_call = False
    """A call may launch a chain's first step and the one ahead of it (else one launch per call)."""
    leader_waiting = False
    """Rank 0 is inside ``run_requests`` waiting for some of its requests (data parallel)."""

    def bind(self, engine, scheduling: Scheduling) -> None:
        """``engine``: the DynamicInferenceEngine this role serves (not annotated: the engine
        imports this module); ``scheduling``: its part of the configuration."""
        self.engine = engine

    def check_can_add(self) -> None:
        """Raises where this rank may not accept requests or aborts."""

    def accept(self, new: NewRequest) -> None:
        self.engine._admit(new)

    def abort(self, request_id) -> bool:
        return self.engine._mark_abort(request_id)

    def pause(self, mode: str | None) -> None:
        """``pause_generation(mode)`` (None: ``resume_generation``)."""
        eng = self.engine
        if mode == "abort":
            for rid in eng._requests:
                eng._mark_abort(rid)
        eng._set_pause(mode)

    def forget(self, request_id: int) -> None:
        """``request_id`` was reported finished."""

    def check_can_generate(self) -> None:
        """After ``open_step``, in a step that would generate: raises ``SuspendError`` where some
        rank's memory is suspended (on every rank alike where ranks share steps)."""
        self.engine.memory.check_can_generate()

    def has_unfinished_requests(self) -> bool:
        return self.engine._has_local_work()

    def still_waiting(self, want: set[int]) -> bool:
        return bool(want)

    def open_step(self, out: StepResult) -> None:
        """At the start of ``step()``, before the aborts and scheduling."""

    def agree_on_launch(self, plan: StepPlan, out: StepResult) -> StepAgreement:
        """What every rank launches in this slot (``plan``: this rank's, maybe empty)."""
        return ALONE

    def landed(self, pending: PendingLaunch) -> None:
        """``pending`` was bookkept."""

    def close_step(self, out: StepResult, landed: bool) -> StepResult:
        """What ``step()`` returns (``landed``: this call bookkept a launch)."""
        return out

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """The element-wise max of ``values`` over the ranks sharing steps, on every rank (each
        calls it at once, outside ``step()``: the warm-up's agreements, capture_agreement.py)."""
        return list(values)


class TensorParallelReplicas(SingleRank):
    admits_at_once = False

    def __init__(self, communicator: ZMQCommunicator, consensus: StepConsensus | None = None):
        self.consensus = StepConsensus(communicator) if consensus is None else consensus
        self.landed_digest = 0
        """Where ranks are replicas: a running digest of the tokens (and accepted counts) landed."""
        self._live: dict[int, None] = {}  # rank 0: accepted ids not reported finished
        self._aborting: set[int] = set()

    def check_can_add(self) -> None:
        self.consensus.check_can_add()

    def max_over_ranks(self, values: list[int]) -> list[int]:
        return self.consensus.comm.all_reduce_max(values)

    def accept(self, new: NewRequest) -> None:
        # admitted by every rank (this one too) at the next exchange
        self.consensus.send(self._routed(new))
        self._live[new.request_id] = None

    def _routed(self, new: NewRequest) -> NewRequest:
        """``new`` with the rank that serves it (replicas: all of them, ``rank`` 0)."""
        return new

    def abort(self, request_id) -> bool:
        self.consensus.check_can_add()
        if not isinstance(request_id, numbers.Integral) or request_id not in self._live or request_id in self._aborting:
            return False
        self._aborting.add(int(request_id))
        self.consensus.send_abort(int(request_id))  # every rank marks it at the next exchange
        return True

    def pause(self, mode: str | None) -> None:
        """Rank 0: every rank applies ``mode`` at the next exchange (the aborts it needs ride it too)."""
        self.consensus.check_can_add()
        if mode == "abort":
            for rid in list(self._live):
                self.abort(rid)
        self.consensus.pause_wanted = PAUSE_MODES.index(mode)

    def check_can_generate(self) -> None:
        last = self.consensus.last  # this step's exchange: the same on every rank
        if last is None:  # none yet (data-parallel ranks exchange after scheduling): this rank's own memory
            super().check_can_generate()
        else:
            check_ranks_can_generate(last.blocked)

    def forget(self, request_id: int) -> None:
        self._live.pop(request_id, None)
        self._aborting.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        """A collective: every rank gets the same answer (and must call it together). It reuses
        the latest agreement while that said "work" (a stale yes costs at most one empty step),
        else exchanges afresh."""
        return self.agreed("any_work")

    def agreed(self, flag: str) -> bool:
        if not self.consensus.said(flag):
            self.agree(from_step=False, out=self.engine._held, upload=self._upload())
        return getattr(self.consensus.last, flag)

    def _upload(self) -> Upload | None:
        return None  # replicas hand nothing up

    def _has_work(self) -> bool:
        return self.engine._has_local_work()

    def agree(self, from_step: bool, out: StepResult, num_tokens: int = 0, eager: bool = False,
              upload: Upload | None = None, variant: int = 0, take_uploads: bool = True) -> Agreement:
        """The per-step exchange; admits the new requests and marks the aborts it brings.
        ``take_uploads`` False: the caller takes the other ranks' results later."""
        sync, eng = self.consensus, self.engine
        with nvtx_range("consensus"):
            got = sync.exchange(self._has_work(), num_tokens, eager, leader_waiting=self.leader_waiting,
                                load=len(eng._requests), upload=upload, from_step=from_step, variant=variant,
                                digest=self.landed_digest, quiet=eng._quiet,
                                blocked=eng.memory.blocking_code(sync.rank))
        sync.record(eng.stats, in_flight=eng._pending is not None)
        for new in got.news:
            eng._admit(new)
        if got.quiet and not sync.is_leader:  # rank 0 reads no updates of these: build none
            eng._quiet.update(got.quiet)
            if len(eng._quiet) > 2 * len(eng._requests) + 64:
                eng._quiet.intersection_update(eng._requests)
        for rid in got.aborts:
            eng._mark_abort(rid)
        if PAUSE_MODES[got.pause] != eng._pause:
            eng._set_pause(PAUSE_MODES[got.pause])
        if take_uploads:
            self._take_uploads(out)
        return got

    def _take_uploads(self, out: StepResult) -> None:
        """Rank 0 of data-parallel ranks: the other ranks' results, handed up at exchanges."""
        for up in self.consensus.take_uploads():
            out.finished.extend(up.finished)
            out.updates.extend(up.updates)
            for o in up.finished:
                self.forget(o.request_id)
            self._heard_evictions(up)

    def _heard_evictions(self, up: Upload) -> None:
        """What ``up``'s rank reported its prefix cache reclaimed (data parallel)."""

    def open_step(self, out: StepResult) -> None:
        sync = self.consensus
        if sync.fresh:  # has_unfinished_requests exchanged and nothing ran since
            sync.fresh = False
        else:
            self.agree(from_step=True, out=out)

    def landed(self, pending: PendingLaunch) -> None:
        if self.consensus.checks_replicas:  # what replicas must have landed alike
            step = int(pending.host_tokens.sum()) * 31 + len(pending.host_tokens)
            if pending.host_accepted is not None:
                step = step * 131 + int(pending.host_accepted.sum())
            self.landed_digest = (self.landed_digest * 1_000_003 + step) % _DIGEST_MOD


class DataParallelRanks(TensorParallelReplicas):
    one_launch_per_call = True

    def __init__(self, communicator: ZMQCommunicator, tensor_parallel_size: int = 1):
        """TP x EP: each data-parallel rank is a TP group whose ranks are replicas (same
        requests, same steps); only its TP rank 0 hands results up."""
        super().__init__(communicator, StepConsensus(communicator, data_parallel=True,
                                                     tensor_parallel_size=tensor_parallel_size))
        self._outgoing = StepResult()
        """Non-leader ranks: results not yet handed up to rank 0."""
        self.router: RankRouter | None = None
        """Rank 0: where each new request goes (rank_router.py)."""
        self.received = 0
        """Requests routed to this rank so far (its evictions are reported with this count)."""
        self._evictions: list[bytes] | None = None
        """Other ranks' (TP rank 0 of a group): digests of the blocks its cache reclaimed, not yet reported."""

    def bind(self, engine, scheduling: Scheduling) -> None:
        super().bind(engine, scheduling)
        sync, config, context = self.consensus, scheduling, engine.context
        if routes_by_prefix(config.dp_routing, context.allocator) and sync.tp_rank == 0 and not sync.is_leader:
            self._evictions = context.allocator.record_evictions()  # reported to rank 0's router (one TP rank per group)
        if sync.is_leader:
            self.router = RankRouter(config.dp_routing, config.dp_routing_alpha, sync.dp_size, config.max_requests,
                                     context.allocator, context.block_size)

    def _routed(self, new: NewRequest) -> NewRequest:
        router = self.router
        digests = router.digests(new.valid.prompt_tokens, new.digests)
        return NewRequest(new.valid, new.request_id, new.seed, router.route(digests), b"".join(digests) or new.digests)

    def agree(self, from_step: bool, out: StepResult, num_tokens: int = 0, eager: bool = False,
              upload: Upload | None = None, variant: int = 0, take_uploads: bool = True) -> Agreement:
        got = super().agree(from_step, out, num_tokens, eager, upload, variant, take_uploads)
        self.received += len(got.news)  # (this rank's news only)
        if self.router is not None:
            self.router.heard(got.loads)
        return got

    def _heard_evictions(self, up: Upload) -> None:
        self.router.evicted(up.dp_rank, up.evicted, up.received)

    def _has_work(self) -> bool:
        eng = self.engine
        return eng._has_local_work() or eng._pending is not None or bool(self._outgoing.finished)

    def _upload(self) -> Upload | None:
        sync = self.consensus
        if sync.is_leader or sync.tp_rank != 0:
            return None
        out, evicted = self._outgoing, take_evicted(self._evictions)
        if not (out.finished or out.updates or evicted):
            return None
        self._outgoing = StepResult()
        return Upload(out.finished, out.updates, sync.dp_rank, self.received, evicted)

    def still_waiting(self, want: set[int]) -> bool:
        """Only rank 0 knows which of its requests are still out: every exchange carries its flag."""
        self.leader_waiting = bool(want) and self.consensus.is_leader
        return self.agreed("leader_waiting")

    def open_step(self, out: StepResult) -> None:
        self.consensus.fresh = False  # the step exchanges after scheduling

    def check_can_generate(self) -> None:
        """The step exchanges only after scheduling, so the latest agreement is the previous
        step's: where it said a rank was suspended, every rank asks afresh (that rank may have
        resumed since, or rank 0 paused again) before scheduling anything."""
        if self.consensus.last is not None and self.consensus.last.blocked:
            eng = self.engine
            self.agree(from_step=True, out=eng._held, upload=self._upload())
            if eng._pause not in (None, "wait"):  # rank 0 paused again: nothing launches
                return
        super().check_can_generate()

    def agree_on_launch(self, plan: StepPlan, out: StepResult) -> StepAgreement:
        graphs = self.engine.runner.graphs
        variant = graphs.replay_variant(plan) if plan and graphs is not None else None
        agreed = self.agree(from_step=True, out=out, num_tokens=plan.num_tokens if plan else 0,
                            eager=bool(plan) and variant is None, upload=self._upload(), variant=variant or 0,
                            take_uploads=False)
        return StepAgreement(agreed.max_tokens, agreed.eager, agreed.variant)

    def close_step(self, out: StepResult, landed: bool) -> StepResult:
        """Rank 0 returns everyone's results (the others', handed up at this step's exchange,
        taken only now: after the launch); the others keep theirs for the next exchange."""
        sync = self.consensus
        if (landed or sync.last.any_work) and out.step_id < 0:
            out.step_id = 0
        if sync.is_leader:
            self._take_uploads(out)
            self.router.take_own_evictions(self.received)
            return out
        if sync.tp_rank == 0:  # other TP ranks hold copies of the same results
            self._outgoing.finished.extend(out.finished)
            self._outgoing.updates.extend(out.updates)
        return StepResult(step_id=out.step_id, num_rows=out.num_rows, is_decode_only=out.is_decode_only,
                          overlapped=out.overlapped, step_time=out.step_time)


def rank_role(communicator: ZMQCommunicator | None, dp_size: int = 1, tp_size: int = 1) -> SingleRank:
    """The role of this rank: alone, a tensor-parallel replica, or one of ``dp_size`` data-parallel
    ranks (each a TP group of ``tp_size``)."""
    if communicator is None:
        return SingleRank()
    if dp_size > 1:
        return DataParallelRanks(communicator, tp_size)
    return TensorParallelReplicas(communicator)
