"""Host time of a LoRA operation's phases (``LoRAAdapters.last_lora_ms``): where a load, an install
or an unload spends the engine thread's time, the first thing to read when one stalls the steps."""
from __future__ import annotations

import time


class PhaseClock:
    def __init__(self):
        self.ms: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        """The time since the last lap (or the start) goes to phase ``name``."""
        now = time.perf_counter()
        self.ms[name] = self.ms.get(name, 0.0) + 1e3 * (now - self._t)
        self._t = now
