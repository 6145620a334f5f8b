"""Keep the engines of a tensor-parallel group in lockstep.

Scheduling is deterministic CPU bookkeeping and sampling is a pure function of (seed,
position, logits), and every rank gets the same full logits. So the ranks only need to
agree on *which requests arrived (or were aborted) before which step*: rank 0 is the only
rank that accepts requests and aborts; at the start of every step it broadcasts those it
accepted since the last one (with the ids and seeds it assigned), and the other ranks apply
the same.
From there every rank schedules, runs and samples identically, with no token traffic."""
from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_async.inference.communication.zmq_communicator import ZMQCommunicator
from megatron_async.inference.request import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    prompt_tokens: list[int]
    sampling_params: SamplingParams
    """With the seed rank 0 drew filled in, so every rank samples the same stream."""
    request_id: int


class TensorParallelSync:
    def __init__(self, communicator: ZMQCommunicator):
        self.comm = communicator
        self._outbox: list[NewRequest] = []
        self._aborts: list[int] = []

    @property
    def is_leader(self) -> bool:
        return self.comm.rank == 0

    def check_can_add(self) -> None:
        if not self.is_leader:
            raise RuntimeError(
                f"tensor-parallel rank {self.comm.rank} cannot add requests or abort them: only rank 0 does, and "
                "the others receive them at the next step()"
            )

    def record(self, prompt_tokens: list[int], sampling_params: SamplingParams, request_id: int, seed: int) -> None:
        """A request this rank accepted: rank 0 sends it with the next step (the others
        received theirs from rank 0 and have nothing to send)."""
        if self.is_leader:
            self._outbox.append(NewRequest(list(prompt_tokens), replace(sampling_params, seed=seed), request_id))

    def record_abort(self, request_id: int) -> None:
        if self.is_leader:
            self._aborts.append(request_id)

    def exchange(self) -> tuple[list[NewRequest], list[int]]:
        """Collective, at every step start: the requests and aborts rank 0 accepted since the
        last one (rank 0 already applied them, so it gets empty lists)."""
        outbox, self._outbox = (self._outbox, self._aborts), []
        self._aborts = []
        received = self.comm.broadcast_object(outbox if self.is_leader else None)
        return ([], []) if self.is_leader else received

    def any_rank(self, flag: bool) -> bool:
        """Collective: True on every rank if ``flag`` is True on any."""
        return self.comm.all_reduce_max([int(flag)])[0] > 0
