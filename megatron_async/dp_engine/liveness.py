"""What keeps a busy engine alive in its coordinator's eyes: while the link's loop thread is inside
a step or a control operation (a long prefill, a weight update), a thread of its own sends a
``heartbeat`` whenever nothing was sent for ``HEARTBEAT_S``, for at most ``watchdog_s`` of one
step, so that a loop thread stuck longer stops vouching for the engine (link.py sends them
between steps itself)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("megatron_async.dp_engine")
HEARTBEAT_S = 1.0
"""An engine says it is there (and its load) when it sent nothing for this long."""


class _Working:
    """``with liveness.working():`` (a class, not a generator: it wraps every step)."""

    __slots__ = ("liveness",)

    def __init__(self, liveness: Liveness):
        self.liveness = liveness

    def __enter__(self) -> None:
        with self.liveness.lock:
            self.liveness.working_since = time.monotonic()

    def __exit__(self, *exc) -> None:
        with self.liveness.lock:
            self.liveness.working_since = None


class Liveness:
    def __init__(self, channel: Any, watchdog_s: float, beat: tuple[int, int]):
        self.channel, self.watchdog_s = channel, watchdog_s
        self.lock = threading.Lock()  # the channel is the heartbeat thread's while working_since is set
        self.working_since: float | None = None
        self.last_sent = time.monotonic()
        self.beat = beat
        """Load and free blocks a heartbeat reports."""

    def working(self) -> _Working:
        """A step or an operation runs on the loop thread: the heartbeat thread owns the channel meanwhile."""
        return _Working(self)

    def run(self, done: threading.Event) -> None:
        """Until ``done``: a heartbeat when nothing was sent for ``HEARTBEAT_S`` and the loop is
        inside a step that has not yet run for ``watchdog_s``."""
        stuck = None
        while not done.wait(HEARTBEAT_S / 4):
            with self.lock:
                since, now = self.working_since, time.monotonic()
                if since is None or now - self.last_sent < HEARTBEAT_S:
                    continue
                if now - since <= self.watchdog_s:
                    self.channel.send("heartbeat", *self.beat)
                    self.last_sent = now
                elif stuck != since:
                    stuck = since
                    log.error("one step has run for %.0f s: no more heartbeats until it returns", now - since)
