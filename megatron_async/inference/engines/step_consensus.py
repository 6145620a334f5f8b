"""The ranks' per-step agreement: ONE exchange per engine step, on the CPU (through shared
memory when every rank is on one host, else a ZMQ round trip; see zmq_communicator.py).

Every exchange is an all-reduce-max of a few ints (plus, for data-parallel engines, one load
slot per rank) that piggybacks rank 0's payload (the requests and aborts it accepted since the
last exchange, each with the rank that serves it) down, only when there is one. The other ranks'
finished outputs and updates go up with it, but nobody waits for them: rank 0 takes them when it
needs them (``take_uploads``). No device collective and no device read-back is involved.

Tensor parallelism (replicas): the exchange sits at the start of ``step()``, before scheduling,
so every rank admits the same requests before the same step; the padded batch and graph choice
then follow identically from identical bookkeeping. Under launch-ahead this runs while the
device executes the step launched by the previous ``step()`` call, so the device never waits
for it unless host work exceeds a device step.

Data-parallel engines (expert parallelism): each rank schedules its own requests first, then
the exchange agrees on whether anyone launches, the largest token count (what every rank pads
to: a rank with nothing to launch runs a dummy forward of that size so the MoE collectives
match) and graph vs eager. Requests routed at this exchange are admitted after the launch it
decides (scheduled from the next step on: one step of admission latency on the receiving rank).

``has_unfinished_requests`` / ``run_requests`` reuse the latest agreement while it said "work"
(a stale yes only costs one empty step at the very end); otherwise they exchange afresh, because
rank 0 may have accepted requests the others cannot know about."""
from __future__ import annotations

import time
from typing import Any, NamedTuple

from megatron_async.inference.communication.zmq_communicator import CommunicatorError, ZMQCommunicator
from megatron_async.inference.engines import step_records
from megatron_async.inference.engines.step_records import NewRequest


class Agreement(NamedTuple):
    """One exchange's outcome (a NamedTuple: one is built per step, and it is cheaper than a
    frozen dataclass)."""

    any_work: bool
    """Some rank has unfinished requests, requests to send, or outputs to hand up."""
    max_tokens: int = 0
    """Data parallel: the most tokens any rank launches in this step (0: nobody forwards)."""
    eager: bool = False
    """Data parallel: some rank's launch is not a graph replay (then no rank replays)."""
    variant: int = 0
    """Data parallel: the largest sampling variant (``graph_plan.variant_index``) a rank's replay
    needs; every rank replays that one (it draws the same tokens for smaller needs)."""
    leader_waiting: bool = False
    """Rank 0 is inside ``run_requests`` waiting for some of its requests."""
    loads: tuple[int, ...] = ()
    """Data parallel: every data-parallel rank's unfinished request count, by rank."""
    news: tuple[NewRequest, ...] | list[NewRequest] = ()
    """The new requests this rank serves, in arrival order."""
    aborts: tuple[int, ...] | list[int] = ()
    quiet: tuple[int, ...] | list[int] = ()
    """Ids among the news whose streaming updates nobody reads (rank 0 waits for their whole
    outputs in ``run_requests``): the serving rank builds and hands up no update for them."""
    pause: int = 0
    """Rank 0's pause state (an index into ``PAUSE_MODES``): every rank applies it at this exchange."""
    blocked: int = 0
    """The max over ranks of ``MemorySuspender.blocking_code`` (0: no rank's memory is suspended):
    every rank learns at the same exchange that some rank cannot generate, and which."""


PAUSE_MODES = (None, "wait", "keep", "abort")
"""``pause_generation`` modes as they ride the exchange (None: generating)."""


_HEAD = 7  # any_work, max_tokens, eager, leader_waiting, variant, pause, blocked; then one load per rank
# (data parallel), then, where ranks are replicas (TP groups), (digest, -digest) per group; last, the arrival time
_NOBODY = -(2**62)  # a group slot this rank does not write: below every digest and negated digest


class StepConsensus:
    def __init__(self, communicator: ZMQCommunicator, data_parallel: bool = False, tensor_parallel_size: int = 1):
        """``tensor_parallel_size`` T (data parallel): every data-parallel rank is a TP group of T
        consecutive communicator ranks (rank = dp_rank * T + tp_rank, as ParallelState numbers
        them); requests are routed to data-parallel ranks and every TP rank of one admits them."""
        self.comm = communicator
        self.data_parallel = data_parallel
        self.rank, self.world_size = communicator.rank, communicator.world_size
        if self.world_size % tensor_parallel_size:
            raise ValueError(f"{self.world_size} ranks do not form TP groups of {tensor_parallel_size}")
        self.dp_rank, self.dp_size = self.rank // tensor_parallel_size, self.world_size // tensor_parallel_size
        self.tp_rank = self.rank % tensor_parallel_size
        # Replica groups: the ranks of one TP group bookkeep identical steps. A digest of what each
        # landed rides the exchange (its max and the max of its negation give max and min), so ranks
        # that diverged (with speculation, different accepted counts: mismatched collectives and a
        # hang) fail at the next exchange, naming it.
        self.replica_size = tensor_parallel_size if data_parallel else self.world_size
        self.checks_replicas = self.replica_size > 1
        self._group = self.dp_rank if data_parallel else 0
        self._outbox: list[NewRequest] = []
        self._aborts: list[int] = []
        self.pause_wanted = 0
        """Rank 0: the pause state (index into ``PAUSE_MODES``) every exchange carries to all ranks."""
        self.last: Agreement | None = None
        self.fresh = False
        """The latest exchange came from has_unfinished / run_requests and no step used it yet."""
        self.rounds = 0
        self.seconds = 0.0
        self.round_seconds = 0.0
        """The latest exchange's duration on this rank (waiting for slower ranks included)."""
        self.latency_seconds = 0.0
        """The latest exchange's cost beyond waiting for peers: from the last rank's arrival to this
        rank holding the result. CLOCK_MONOTONIC is one clock per host, so this is meaningful
        with every rank on one host (the usual single-node torchrun)."""
        self.work_seconds = 0.0
        """The latest exchange's duration less its wait for the other ranks: the host work it
        took on this rank (the part that adds to a step however early the peers are)."""
        # rank 0's news down, StepResults up: the engine's records on the wire (step_records.py)
        communicator.payload_codec = (step_records.encode_payload, step_records.decode_payload)
        if data_parallel:
            communicator.upload_codec = (step_records.encode_upload, step_records.decode_upload)
        # This rank's record, laid out once: _HEAD flags, a load slot per data-parallel rank (its
        # own at _load_at), (digest, -digest) per replica group (its own at _digest_at), arrival.
        num_loads = self.dp_size if data_parallel else 0
        groups = self.world_size // self.replica_size if self.checks_replicas else 0
        self._record = [0] * (_HEAD + num_loads) + [_NOBODY] * (2 * groups) + [0]
        self._load_at = _HEAD + self.dp_rank if data_parallel else -1
        self._loads = slice(_HEAD, _HEAD + num_loads)
        self._digest_at = _HEAD + num_loads + 2 * self._group if self.checks_replicas else -1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def check_can_add(self) -> None:
        if not self.is_leader:
            kind = "data-parallel" if self.data_parallel else "tensor-parallel"
            raise RuntimeError(
                f"{kind} rank {self.rank} cannot add requests, abort them or pause generation: only rank 0 does, and "
                "the others receive them at the next step()"
            )

    # ------------------------------------------------------------------ rank 0's outbox
    def send(self, new: NewRequest) -> None:
        self._outbox.append(new)

    def send_abort(self, request_id: int) -> None:
        self._aborts.append(request_id)

    def has_outgoing(self) -> bool:
        return bool(self._outbox or self._aborts)

    def outgoing_ids(self) -> set[int]:
        return {n.request_id for n in self._outbox}

    # ------------------------------------------------------------------ the exchange
    def exchange(self, has_work: bool, num_tokens: int = 0, eager: bool = False, leader_waiting: bool = False,
                 load: int = 0, upload: Any = None, from_step: bool = True, variant: int = 0,
                 digest: int = 0, quiet: set[int] | frozenset[int] = frozenset(), blocked: int = 0) -> Agreement:
        """Collective: one round trip. Returns the agreement, with the news and aborts this
        rank must apply (rank 0's included: it applies its own outbox only here, like the rest).
        ``digest``: of the steps this rank has landed (must match across a replica group).
        ``quiet`` (rank 0): ids whose updates nobody reads; those among the news say so.
        ``blocked``: this rank's ``MemorySuspender.blocking_code`` (0: its memory is all there).

        The common step (nothing to send down, nothing to hand up) moves only this rank's record
        of ints: nothing encoded anywhere (``comm.plain_rounds`` counts those rounds)."""
        t0 = time.perf_counter()
        probe = self.comm.probe
        if probe is not None:
            probe.start()
        rec = self._record
        rec[0] = 1 if has_work or upload is not None or self._outbox or self._aborts else 0  # handing up is work
        rec[1], rec[2], rec[3], rec[4] = num_tokens, 1 if eager else 0, 1 if leader_waiting else 0, variant
        rec[5], rec[6] = self.pause_wanted if self.is_leader else 0, blocked
        if self._load_at >= 0:
            rec[self._load_at] = load
        if self._digest_at >= 0:
            rec[self._digest_at], rec[self._digest_at + 1] = digest, -digest
        rec[-1] = time.monotonic_ns() // 1000  # arrival, us; the max over ranks is the last arrival
        payload = None
        if self.is_leader and (self._outbox or self._aborts):
            outbox = self._outbox
            payload = (outbox, self._aborts, [n.request_id for n in outbox if n.request_id in quiet] if quiet else [])
            self._outbox, self._aborts = [], []
        if probe is not None:
            probe.mark("build")
        result, payload = self.comm.exchange(rec, upload, payload)  # None: nothing sent
        if self._digest_at >= 0 and result[self._digest_at] != -result[self._digest_at + 1]:
            raise CommunicatorError(
                f"replica ranks diverged: rank {self.rank}'s landed steps differ from another rank of its "
                f"tensor-parallel group (digests from {-result[self._digest_at + 1]} to {result[self._digest_at]}, "
                f"exchange #{self.rounds + 1}): their device results were not identical")
        if payload is None:
            last = Agreement(result[0] != 0, result[1], result[2] != 0, result[4], result[3] != 0,
                             tuple(result[self._loads]), pause=result[5], blocked=result[6])
        else:
            news, aborts, quiet_ids = payload
            if self.data_parallel:
                news = [n for n in news if n.rank == self.dp_rank]
            last = Agreement(result[0] != 0, result[1], result[2] != 0, result[4], result[3] != 0,
                             tuple(result[self._loads]), news, aborts, quiet_ids, result[5], result[6])
        self.last = last
        self.fresh = not from_step
        self.rounds += 1
        self.latency_seconds = max(0, time.monotonic_ns() // 1000 - result[-1]) / 1e6
        self.round_seconds = time.perf_counter() - t0
        self.work_seconds = max(0.0, self.round_seconds - self.comm.waited_ns / 1e9)
        self.seconds += self.round_seconds
        if probe is not None:
            probe.mark("apply")
            probe.end()
        return last

    def record(self, stats, in_flight: bool) -> None:
        """Copy the latest exchange into ``stats`` (EngineStats). ``in_flight``: a launch was
        on the device while it ran (launch-ahead: the exchange overlapped that step)."""
        stats.consensus_rounds = self.rounds
        stats.consensus_time = self.seconds
        stats.consensus_round_seconds.append(self.round_seconds)
        stats.consensus_latency_seconds.append(self.latency_seconds)
        stats.consensus_work_seconds.append(self.work_seconds)
        stats.consensus_overlapped_rounds += in_flight
        comm = self.comm
        stats.consensus_plain_rounds, stats.consensus_sleeps = comm.plain_rounds, comm.sleeps
        stats.consensus_wire = comm.wire_stats

    def take_uploads(self) -> list[Any]:
        """Rank 0: what the other ranks handed up at the exchanges so far (not yet taken), by
        round then rank; [] elsewhere. Results, not decisions: the exchange does not wait for
        them, and rank 0 takes them when it needs them (after launching its step)."""
        if not (self.is_leader and self.data_parallel):  # (replicas hand nothing up)
            return []
        probe = self.comm.probe
        if probe is not None:
            probe.start()
        got = self.comm.take_uploads()
        if probe is not None:
            probe.end("take_uploads")
        return got

    def said(self, name: str) -> bool:
        """The latest agreement's flag ``name`` if it is True (a stale yes is safe), else None."""
        return self.last is not None and bool(getattr(self.last, name))
