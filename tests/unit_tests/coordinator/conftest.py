"""A coordinator serving on a thread of the test's process, on a loopback port, with no secret
configured (its secret file and ipc twin under a runtime directory of the test's own, short
enough for a Unix socket's name: its peers connect through the twin)."""
from __future__ import annotations

import shutil
import tempfile

import pytest

from tests.helpers.coordinator_thread import serving


@pytest.fixture
def runtime_dir(monkeypatch):
    path = tempfile.mkdtemp(prefix="coord-")
    monkeypatch.setenv("XDG_RUNTIME_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def server(monkeypatch, runtime_dir):
    s, stop, t = serving(monkeypatch)
    yield s
    stop.set()
    t.join(5)
    s.close()
