"""The cyclic garbage collector while an engine serves: what start-up built is frozen, and every
collection's pause is counted.

A collection of Python's oldest generation traverses every tracked object. After start-up an
engine process holds ~200,000 of them (modules, parameters, tokenizer tables, Triton's kernel
caches): one such collection takes ~85 ms on a 2-core VM, and the loop thread that runs it is
the thread that launches the next step, so every running request sees one long inter-token gap.
With ``InferenceConfig.gc_freeze`` (on in the processes that exist to serve) ``settle()`` ends
the build: it collects start-up's garbage and moves what survives into the permanent generation
(``gc.freeze``), so later collections traverse only what serving allocated since; ``thaw()`` when
that engine closes gives them back. The freeze is the whole process's (Python has one), which is
why a library caller's process keeps it off: a dropped, unclosed engine would never be collected,
and a caller's own freeze would be undone at close. One process-wide record of every
collection's pause (``gc.callbacks``): a collection stops every thread."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass


@dataclass
class Pauses:
    collections: int = 0
    """Collections of any generation since the last ``watch()``."""
    full_collections: int = 0
    """Of those, of the oldest generation (2)."""
    seconds: float = 0.0
    max_seconds: float = 0.0
    _started: float = 0.0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.collections += 1
        self.full_collections += info.get("generation") == 2
        self.seconds += took
        self.max_seconds = max(self.max_seconds, took)

    def reset(self) -> None:
        self.collections = self.full_collections = 0
        self.seconds = self.max_seconds = 0.0


PAUSES = Pauses()


def watch() -> None:
    """Count collections from now on (start-up's own are not serving's)."""
    if PAUSES.callback not in gc.callbacks:
        gc.callbacks.append(PAUSES.callback)
    PAUSES.reset()


def settle() -> None:
    """Start-up is over: its garbage goes now, and what survives stays out of later collections."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Frozen objects are collectable again (the engine that froze them closes)."""
    gc.unfreeze()


def record(stats) -> None:
    """Copy the process's pauses into ``EngineStats``."""
    stats.gc_collections, stats.gc_full_collections = PAUSES.collections, PAUSES.full_collections
    stats.gc_pause_seconds, stats.gc_pause_max_seconds = PAUSES.seconds, PAUSES.max_seconds
