"""A coordinator serving on a thread (tests, and its process under SIGTERM / SIGINT) ends within a
short poll once its stop event is set, not after the loop's one-second tick."""
from __future__ import annotations

import time

from megatron_async.coordinator.server import STOP_POLL_S, TICK_S
from tests.helpers.coordinator_thread import serving


def test_a_stop_event_ends_the_loop_within_its_poll(monkeypatch, runtime_dir):
    s, stop, t = serving(monkeypatch)
    time.sleep(3 * STOP_POLL_S)  # idle in its poll
    t0 = time.monotonic()
    stop.set()
    t.join(5)
    took = time.monotonic() - t0
    s.close()
    assert not t.is_alive() and took < 4 * STOP_POLL_S < TICK_S, took
