"""Control operations a client sends to every engine (pause, resume, suspend, set the generation
epoch, update weights, stop) or to some (``SUBSET_OPS``), and drains of one engine, collated: the
client gets one answer once every engine it went to answered, or left, or died.

The answer is (status, body): 200 when every engine said 200, else the largest status any
engine gave; the body holds each engine's own body by index (``{"engines": {"0": {...}}}``;
msgpack maps have string keys here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WEIGHT_TRANSFER_OPS = ("init_weight_transfer", "update_weights_from_distributed", "update_weights_from_ipc",
                       "destroy_weight_transfer", "update_lora_from_distributed", "update_lora_from_ipc")
"""The refit path's operations (dp_engine/engine_ops.py) a client may run on every engine."""
CONTROL_OPS = frozenset({"pause_generation", "resume_generation", "suspend", "resume", "set_generation_epoch",
                         "update_weights", "stop", "stats", "load_lora_adapter", "unload_lora_adapter",
                         *WEIGHT_TRANSFER_OPS})
"""What a client may ask of every engine (the engine side runs them: dp_engine/link.py)."""
SUBSET_OPS = frozenset({"update_weights", "stats", "load_lora_adapter", "unload_lora_adapter", *WEIGHT_TRANSFER_OPS})
"""Operations a client may send to some engines only (``args["engines"]``: their indexes), e.g.
each engine its own ``rank_offset`` in a trainer's transfer group; the others change state the
coordinator keeps for every engine (pause mode, generation epoch), and go to all."""


@dataclass(eq=False)
class PendingControl:
    client: Any
    op_id: int
    op: str
    waiting: set[int]
    """Indexes of the engines that have not answered yet."""
    answers: dict[str, Any] = field(default_factory=dict)
    status: int = 200


class ControlBook:
    def __init__(self):
        self._pending: dict[int, PendingControl] = {}  # internal id (what engines echo) -> operation
        self._next_id = 0
        self.drains: dict[int, list[tuple[Any, int]]] = {}
        """Engine index -> the (client, op id) of each drain of it waiting for it to leave."""

    def open(self, client: Any, op_id: int, op: str, engines: list[int]) -> tuple[int, PendingControl]:
        """A new operation sent to ``engines``: (the id the engines echo, its record). ``client``
        None: the coordinator's own (a late engine told the current pause mode): nobody is answered."""
        internal = self._next_id
        self._next_id += 1
        pc = self._pending[internal] = PendingControl(client, op_id, op, set(engines))
        return internal, pc

    def answer(self, internal: int, engine: int, status: int, body: Any) -> PendingControl | None:
        """An engine's answer; the operation when it was the last one awaited (then forgotten)."""
        pc = self._pending.get(internal)
        if pc is None or engine not in pc.waiting:
            return None
        pc.waiting.discard(engine)
        pc.answers[str(engine)] = body
        if status != 200:
            pc.status = max(pc.status, status) if pc.status != 200 else status
        return self._complete(internal, pc)

    def engine_gone(self, engine: int, died: bool) -> list[PendingControl]:
        """Operations that waited only for ``engine``, now complete without its answer."""
        done = []
        for internal, pc in list(self._pending.items()):
            if engine in pc.waiting:
                pc.waiting.discard(engine)
                pc.answers[str(engine)] = {"gone": "died" if died else "left"}
                if (finished := self._complete(internal, pc)) is not None:
                    done.append(finished)
        return done

    def client_gone(self, client: Any) -> None:
        """Its operations still run on the engines; their answers go nowhere."""
        for pc in self._pending.values():
            if pc.client == client:
                pc.client = None
        for index, waiting in self.drains.items():
            self.drains[index] = [(c, op) for c, op in waiting if c != client]

    def _complete(self, internal: int, pc: PendingControl) -> PendingControl | None:
        if pc.waiting:
            return None
        del self._pending[internal]
        return pc

    def __len__(self) -> int:
        return len(self._pending)
