"""A coordinator serving on a thread of the test's process, on a loopback port, with no secret
configured (its secret file under the test's own runtime directory)."""
from __future__ import annotations

import threading

import pytest

from megatron_async.coordinator.server import CoordinatorServer
from megatron_async.coordinator.trust import ENV_SECRET


@pytest.fixture
def server(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv(ENV_SECRET, raising=False)
    s = CoordinatorServer("tcp://127.0.0.1:0")
    stop = threading.Event()
    t = threading.Thread(target=s.serve, args=(stop,), daemon=True)
    t.start()
    yield s
    stop.set()
    t.join(5)
    s.close()
