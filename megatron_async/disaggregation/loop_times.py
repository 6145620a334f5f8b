"""What the hand-off costs an engine's loop: the host time of its hand-off work per turn (kv
messages, polling the connections, admitting imports), its longest turn, and on a decode engine
each import's time from its posted receive to its admission. The loop never waits on a transfer,
so these stay small beside a step; a long turn here is a step that came late."""
from __future__ import annotations

import time
from contextlib import contextmanager


class LoopTimes:
    def __init__(self):
        self.seconds = self.max_seconds = self.import_seconds = 0.0
        self.imports = 0

    @contextmanager
    def timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.seconds += spent
            self.max_seconds = max(self.max_seconds, spent)

    def imported(self, seconds: float) -> None:
        """An import admitted ``seconds`` after its receive was posted."""
        self.imports += 1
        self.import_seconds += seconds

    def counters(self) -> dict:
        return {"kv_loop_seconds": self.seconds, "kv_loop_max_seconds": self.max_seconds,
                "kv_imports_landed": self.imports, "kv_import_seconds": self.import_seconds}
