"""A one-line progress display on stderr (rewritten with \\r), off when stderr is not a terminal."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None, min_interval_s: float = 0.1):
        self.stream = stream or sys.stderr
        self.total = total
        self.enabled = enabled and self.stream.isatty()
        self.min_interval_s = min_interval_s
        self._start = time.perf_counter()
        self._last = 0.0

    def update(self, done: int, tokens: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.min_interval_s:
            return  # redrawing every step would cost more than a small decode step
        self._last = now
        elapsed = now - self._start
        width = 30
        filled = width * done // max(1, self.total)
        rate = tokens / elapsed if elapsed > 0 else 0.0
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests "
            f"{tokens} tokens {rate:,.0f} tok/s {elapsed:.1f}s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
