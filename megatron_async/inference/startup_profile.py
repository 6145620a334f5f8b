"""Where an engine's start-up goes: wall time and Triton builds per phase, from the ``LLM``
constructor to an engine ready to serve (``LLM.startup``; the main job prints it).

Phases: ``load`` (weights and tokenizer), ``memory profile`` (the probe step that sizes the KV
pool on CUDA), ``engine`` (context with its KV pool, model runner, graph runner, engine),
then the warm-up's ``kernel builds`` (dry captures + threaded Triton builds), ``eager steps``
and ``graph captures``. A Triton build is a compile, or a load from Triton's on-disk cache
(``cache_dir``), which a later process on the same machine hits."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from megatron_async.inference import triton_builds


@dataclass
class Phase:
    seconds: float = 0.0
    builds: int = 0
    """Triton builds during the phase (process-wide count)."""
    note: str = ""


@dataclass
class StartupProfile:
    phases: dict[str, Phase] = field(default_factory=dict)
    total_seconds: float = 0.0
    cache_dir: str | None = None
    """Triton's on-disk kernel cache (TRITON_CACHE_DIR, default ~/.triton/cache)."""

    _open: tuple | None = None
    _parts: list = field(default_factory=list)

    def begin(self, name: str) -> None:
        """Start timing phase ``name`` (``end`` stops it)."""
        self._open = (name, time.perf_counter(), triton_builds.builds())
        self._parts = []

    def end(self) -> None:
        name, t0, builds0 = self._open
        note = ", ".join(f"{part} {seconds:.2f} s" for part, seconds in self._parts)
        self.phases[name] = Phase(time.perf_counter() - t0, triton_builds.builds() - builds0, note)
        self._open = None

    @contextlib.contextmanager
    def part(self, name: str):
        """Time a block of the open phase; the phase's note lists its parts."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._parts.append((name, time.perf_counter() - t0))

    @contextlib.contextmanager
    def phase(self, name: str):
        """``begin`` / ``end`` around a block."""
        self.begin(name)
        try:
            yield
        finally:
            self.end()

    def add_warmup(self, report) -> None:
        """The phases of a ``WarmupReport``."""
        pre = report.prebuild
        if pre is not None:
            self.phases["kernel builds"] = Phase(pre.seconds, pre.kernels, pre.describe())
        builds_eager = report.triton_builds - report.capture_builds - (pre.kernels if pre else 0)
        self.phases["eager steps"] = Phase(report.eager_seconds, max(0, builds_eager), f"{report.eager_steps} steps")
        if report.graphs_captured:
            skipped, retried = report.captures_without_eager_run, report.capture_retries
            self.phases["graph captures"] = Phase(report.capture_seconds, report.capture_builds,
                                                  f"{report.graphs_captured} graphs"
                                                  + (f", {skipped} without an eager run first" if skipped else "")
                                                  + (f", {retried} captured again after one" if retried else ""))

    def as_dict(self) -> dict:
        return {"total_seconds": self.total_seconds, "cache_dir": self.cache_dir,
                "phases": {k: vars(v) for k, v in self.phases.items()}}

    def rows(self) -> list[tuple[str, str]]:
        """(phase, "seconds, builds, note") rows for a summary table."""
        out = []
        for name, p in self.phases.items():
            extra = [f"{p.builds} Triton builds"] if p.builds else []
            extra += [p.note] if p.note else []
            out.append((name, f"{p.seconds:.2f} s" + (f" ({', '.join(extra)})" if extra else "")))
        return out
