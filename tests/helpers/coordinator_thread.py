"""A coordinator serving on a thread of the test's process, on a loopback port, with no secret
configured (the unit tests' server fixture, and tests that stop it themselves)."""
from __future__ import annotations

import threading

from megatron_async.coordinator.server import CoordinatorServer
from megatron_async.coordinator.trust import ENV_SECRET


def serving(monkeypatch) -> tuple[CoordinatorServer, threading.Event, threading.Thread]:
    """A coordinator on a loopback port serving on a thread until the event is set."""
    monkeypatch.delenv(ENV_SECRET, raising=False)
    s = CoordinatorServer("tcp://127.0.0.1:0")
    stop = threading.Event()
    t = threading.Thread(target=s.serve, args=(stop,), daemon=True)
    t.start()
    return s, stop, t
