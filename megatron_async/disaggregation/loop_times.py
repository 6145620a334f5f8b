"""What the hand-off costs an engine's loop: the host time of its hand-off work per turn (kv
messages, polling the connections, admitting imports), its longest turn and what that turn spent
its time on, and on a decode engine each import's time from its posted receive to its admission.
The loop never waits on a transfer, so these stay small beside a step; a long turn here is a step
that came late, and its parts name the work that made it long.

Parts of a turn (``part``): "message" (a kv message handled), "announce" (kv_ready of the requests
that stopped at their first token), "admit" (deferred imports given blocks and their receives
posted), "land" (ended transfers: imports admitted decoding), "connect" (a pair connection's
object made: its set-up runs on its own thread), "poll" (the rest: the connections' queries).
Time outside every named part counts as "poll". Each part's total beside its longest tells a
one-off turn (a set-up, a collection of the garbage collector, the GIL held by another thread)
from steady work."""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager

from megatron_async.inference.engines.engine_stats import nearest_rank

PARTS = ("message", "announce", "admit", "land", "connect", "poll")
KEPT_IMPORTS = 4096
"""Import times kept for their percentiles (the latest)."""


class LoopTimes:
    def __init__(self):
        self.seconds = self.max_seconds = self.import_seconds = 0.0
        self.imports = self.messages = 0
        self.part_seconds = dict.fromkeys(PARTS, 0.0)
        """Per part, its time in all turns."""
        self._import_times: deque[float] = deque(maxlen=KEPT_IMPORTS)
        self.part_max = dict.fromkeys(PARTS, 0.0)
        """Per part, its longest time in one turn."""
        self.longest = dict.fromkeys(PARTS, 0.0)
        """The longest turn's time per part."""
        self._turn: dict[str, float] | None = None  # the turn being timed: part -> seconds
        self._open: list[list[float]] = []  # the parts being timed, innermost last: [their inner parts' seconds]

    @contextmanager
    def timed(self):
        """One turn of hand-off work (a kv message, a poll)."""
        start = time.perf_counter()
        self._turn = dict.fromkeys(PARTS, 0.0)
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            parts, self._turn = self._turn, None
            self._open.clear()
            parts["poll"] += max(0.0, spent - sum(parts.values()))
            self.seconds += spent
            for name, seconds in parts.items():
                self.part_max[name] = max(self.part_max[name], seconds)
                self.part_seconds[name] += seconds
            if spent > self.max_seconds:
                self.max_seconds, self.longest = spent, parts

    @contextmanager
    def part(self, name: str):
        """Time spent on ``name`` (one of ``PARTS``) within the turn being timed; a part inside
        another counts for itself, not for the outer one."""
        turn = self._turn
        if turn is None:
            yield
            return
        inner = [0.0]
        self._open.append(inner)
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self._open.pop()
            turn[name] += spent - inner[0]
            if self._open:
                self._open[-1][0] += spent

    def imported(self, seconds: float) -> None:
        """An import admitted ``seconds`` after its receive was posted."""
        self.imports += 1
        self.import_seconds += seconds
        self._import_times.append(seconds)

    def counters(self) -> dict:
        out = {"kv_loop_seconds": self.seconds, "kv_loop_max_seconds": self.max_seconds,
               "kv_imports_landed": self.imports, "kv_import_seconds": self.import_seconds,
               "kv_import_p50_seconds": nearest_rank(self._import_times, 50),
               "kv_import_p99_seconds": nearest_rank(self._import_times, 99),
               "kv_loop_messages": self.messages}
        for name in PARTS:
            out[f"kv_loop_max_{name}_seconds"] = self.part_max[name]
            out[f"kv_loop_total_{name}_seconds"] = self.part_seconds[name]
            out[f"kv_loop_longest_{name}_seconds"] = self.longest[name]
        return out
