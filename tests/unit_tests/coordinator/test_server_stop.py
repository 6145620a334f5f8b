"""A coordinator serving on a thread (tests, and its process under SIGTERM / SIGINT) ends within a
short poll once its stop event is set, not after the loop's one-second tick."""
from __future__ import annotations

import threading
import time

from megatron_async.coordinator.server import STOP_POLL_S, TICK_S, CoordinatorServer
from megatron_async.coordinator.trust import ENV_SECRET


def test_a_stop_event_ends_the_loop_within_its_poll(monkeypatch, runtime_dir):
    monkeypatch.delenv(ENV_SECRET, raising=False)
    s = CoordinatorServer("tcp://127.0.0.1:0")
    stop = threading.Event()
    t = threading.Thread(target=s.serve, args=(stop,), daemon=True)
    t.start()
    time.sleep(3 * STOP_POLL_S)  # idle in its poll
    t0 = time.monotonic()
    stop.set()
    t.join(5)
    took = time.monotonic() - t0
    s.close()
    assert not t.is_alive() and took < 4 * STOP_POLL_S < TICK_S, took
