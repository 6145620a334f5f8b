"""The control operations of an engine serving a coordinator (``EngineLink``'s, link.py): "stop",
and the admin / refit / LoRA operations of ``engine_ops.py``, run between two steps and answered
with ``control_done``; one that waits for another process (a transfer group's set-up, an update's
senders: a ``Deferred``) is answered at a later turn, once its wait ended, while the link keeps
stepping. Under tensor parallelism the other ranks run (and settle) every-rank operations too. The
answer to a LoRA operation carries the adapters the engine holds afterwards (``"loras"``), whatever
its outcome: the coordinator routes adapters' requests on them (coordinator/adapters.py)."""
from __future__ import annotations

import time

from megatron_async.coordinator.adapters import LORA_OPS
from megatron_async.dp_engine.engine_ops import EVERY_RANK_OPS, Deferred, run_engine_op

DEFERRED_POLL_S = 0.05
"""Longest idle wait for messages while a control operation waits off the loop (``Deferred``)."""


class LinkControls:
    """Mixed into ``EngineLink``, whose state (engine, channel, liveness, handoffs, requests) it uses."""

    def _control(self, op_id: int, op: str, args: dict) -> None:
        if op == "stop":
            if self.handoffs is not None:
                self.handoffs.admit_waiting()
            self._leaving = "stop"
            for local in list(self._rid_of):
                self.engine.abort_request(local)
            self._stop_reply = (op_id, (200, {"stopped": True}))
            return
        with self.liveness.working():
            if op in EVERY_RANK_OPS:
                self._tell_ranks(("admin", op, args))  # the other TP ranks run it too (follow_rank0)
            outcome = run_engine_op(self.engine, op, args, self._update_weights)
        if isinstance(outcome, Deferred):  # it waits off this thread: settled at a later turn once done
            self._deferred.append((op_id, op, outcome))
            return
        self._control_done(op_id, op, outcome)

    def _control_done(self, op_id: int, op: str, outcome: tuple[int, dict]) -> None:
        status, body = outcome
        if op == "stats" and status == 200 and self.handoffs is not None:
            body.update(self.handoffs.counters())
        if op in LORA_OPS:
            body = {**body, "loras": held_adapters(self.engine)}
        self.channel.send("control_done", op_id, status, body)
        self.liveness.last_sent = time.monotonic()

    def _settle(self) -> None:
        """Finish the deferred operations whose wait ended (between two steps)."""
        for entry in [e for e in self._deferred if e[2].done()]:
            self._deferred.remove(entry)
            op_id, op, deferred = entry
            with self.liveness.working():
                if op in EVERY_RANK_OPS:
                    self._tell_ranks(("settle", deferred.key))
                outcome = deferred.settle()
            self._control_done(op_id, op, outcome)


def held_adapters(engine) -> list[str]:
    """The LoRA adapters ``engine`` holds now, by name (an engine stand-in may have no adapters' table)."""
    adapters = getattr(engine.context, "lora", None)
    return [] if adapters is None else sorted(adapters.loaded)
