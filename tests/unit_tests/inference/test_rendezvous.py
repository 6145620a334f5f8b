"""The ranks' rendezvous (rendezvous.py): bind rules and secret sources, decided through a store."""
from __future__ import annotations

import logging
import os
import shutil
import stat
import threading

import pytest
from torch.distributed import HashStore

from megatron_async.inference.communication import rendezvous as rv


def _plans(world: int, **kw) -> list[rv.Plan]:
    store, out = HashStore(), [None] * world

    def one(r):
        out[r] = rv.plan(store, r, world, "k", **kw)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    _made.append(out[0].directory)
    return out


_made: list[str] = []


@pytest.fixture(autouse=True)
def _remove_directories():
    yield
    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)


def test_ranks_on_one_host_bind_ipc_only_with_a_private_secret(monkeypatch):
    monkeypatch.delenv(rv.SECRET_ENV, raising=False)
    monkeypatch.delenv(rv.SECRET_FILE_ENV, raising=False)
    plans = _plans(3)
    p0 = plans[0]
    assert p0.all_local and p0.secret_source == "local-file" and len(p0.secret) == 32
    assert p0.bind == (f"ipc://{p0.directory}/ranks",)  # no TCP port at all
    assert {p.secret for p in plans} == {p0.secret} and {p.job for p in plans} == {p0.job}
    assert stat.S_IMODE(os.stat(p0.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(p0.directory, "secret")).st_mode) == 0o600


def test_ranks_spanning_hosts_bind_tcp_and_warn_without_an_env_secret(monkeypatch, caplog):
    monkeypatch.delenv(rv.SECRET_ENV, raising=False)
    monkeypatch.delenv(rv.SECRET_FILE_ENV, raising=False)
    with caplog.at_level(logging.WARNING, "megatron_async"):
        plans = _plans(2, force_tcp=True)
    assert not plans[0].all_local and plans[0].secret_source == "store" and plans[1].secret == plans[0].secret
    assert plans[0].bind[1].startswith("tcp://") and not plans[0].bind[1].startswith("tcp://0.0.0.0")
    assert plans[1].directory is None and "MEGATRON_ASYNC_SECRET" in caplog.text


def test_an_env_secret_wins_and_never_enters_the_store(monkeypatch, tmp_path):
    monkeypatch.setenv(rv.SECRET_ENV, "e" * 20)
    plans = _plans(2, force_tcp=True)
    assert [p.secret for p in plans] == [b"e" * 20] * 2 and plans[0].secret_source == "env"
    monkeypatch.delenv(rv.SECRET_ENV)
    path = tmp_path / "secret"
    path.write_bytes(b"f" * 20 + b"\n")
    path.chmod(0o644)
    monkeypatch.setenv(rv.SECRET_FILE_ENV, str(path))
    with pytest.raises(rv.SecretError, match="chmod 600"):
        rv.secret_from_env()
    path.chmod(0o600)
    assert rv.secret_from_env() == (b"f" * 20, "file")
    monkeypatch.setenv(rv.SECRET_ENV, "short")
    with pytest.raises(rv.SecretError, match="at least 16"):
        rv.secret_from_env()


def test_a_directory_others_can_enter_is_not_private(tmp_path):
    assert rv.private_dir_ok(str(tmp_path)) == (not stat.S_IMODE(os.stat(tmp_path).st_mode) & 0o077)
    tmp_path.chmod(0o755)
    assert not rv.private_dir_ok(str(tmp_path))
    tmp_path.chmod(0o700)
    assert rv.private_dir_ok(str(tmp_path))
