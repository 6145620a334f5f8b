"""A coordinator serving on a thread of the test's process, on a loopback port, with no secret
configured (its secret file and ipc twin under a runtime directory of the test's own, short
enough for a Unix socket's name: its peers connect through the twin)."""
from __future__ import annotations

import shutil
import tempfile
import threading

import pytest

from megatron_async.coordinator.server import CoordinatorServer
from megatron_async.coordinator.trust import ENV_SECRET


@pytest.fixture
def runtime_dir(monkeypatch):
    path = tempfile.mkdtemp(prefix="coord-")
    monkeypatch.setenv("XDG_RUNTIME_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serving(monkeypatch) -> tuple[CoordinatorServer, threading.Event, threading.Thread]:
    """A coordinator on a loopback port serving on a thread until the event is set."""
    monkeypatch.delenv(ENV_SECRET, raising=False)
    s = CoordinatorServer("tcp://127.0.0.1:0")
    stop = threading.Event()
    t = threading.Thread(target=s.serve, args=(stop,), daemon=True)
    t.start()
    return s, stop, t


@pytest.fixture
def server(monkeypatch, runtime_dir):
    s, stop, t = serving(monkeypatch)
    yield s
    stop.set()
    t.join(5)
    s.close()
