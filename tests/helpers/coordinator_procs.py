"""A data-parallel coordinator and its engines as the processes a user starts
(``python -m megatron_async.coordinator``, ``python -m megatron_async.serve --join``), for tests
and measurements: each waits for its ready line with a deadline, and every process is stopped at
``close`` (none outlives its test)."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY_ENGINE = ["--default-model", "tiny", "--device", "cpu", "--dtype", "float32"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            "OMP_NUM_THREADS": "1"}


def _wait_line(proc: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    deadline, buf = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.startswith(prefix):
                return line[len(prefix):].strip()
            buf += line
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{proc.args[2]} did not start (exit code {proc.poll()}): {buf[-2000:]}")


class Cluster:
    """``c = Cluster(policy)``; ``c.add_engine(name, *flags)``; ``c.address``; ``c.close()``."""

    def __init__(self, policy: str = "load_balanced", alpha: float = 0.5, timeout_s: float = 120.0,
                 extra: tuple[str, ...] = ()):
        self.timeout_s = timeout_s
        self.engines: dict[str, subprocess.Popen] = {}
        self.coordinator = subprocess.Popen(
            [sys.executable, "-m", "megatron_async.coordinator", "--listen", "tcp://127.0.0.1:0", "--dp-routing", policy,
             "--dp-routing-alpha", str(alpha), *extra], stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
        self.address = _wait_line(self.coordinator, "megatron_async.coordinator: listening on ", timeout_s)

    def start_engine(self, name: str, *flags: str, model: tuple[str, ...] = TINY_ENGINE,
                     env: dict | None = None) -> subprocess.Popen:
        """Start an engine process (``add_engine`` waits for it): ``model`` flags (the tiny model
        on the CPU), then ``flags``; ``env``: more environment (CUDA_VISIBLE_DEVICES)."""
        proc = subprocess.Popen([sys.executable, "-m", "megatron_async.serve", "--join", self.address, "--engine-name",
                                 name, *model, *flags], stdout=subprocess.PIPE, text=True, env={**_env(), **(env or {})},
                                cwd=ROOT)
        self.engines[name] = proc
        return proc

    def wait_engine(self, name: str) -> int:
        """Its index at the coordinator, once it registered."""
        line = _wait_line(self.engines[name], "megatron_async.serve: engine ", self.timeout_s)
        return int(line.split()[0])

    def add_engine(self, name: str, *flags: str, **kw) -> int:
        self.start_engine(name, *flags, **kw)
        return self.wait_engine(name)

    def start_server(self, *flags: str) -> tuple[subprocess.Popen, str]:
        """``python -m megatron_async.serve --engine ADDR`` on a free port: (its process, its URL)."""
        proc = subprocess.Popen([sys.executable, "-m", "megatron_async.serve", "--engine", self.address, "--port", "0",
                                 *flags], stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
        self.engines[f"server{len(self.engines)}"] = proc
        return proc, _wait_line(proc, "megatron_async.serve: serving ", self.timeout_s).split()[2]

    def close(self, grace_s: float = 10.0) -> None:
        """Engines then the coordinator get SIGTERM (as a user stops them: the coordinator removes
        its secret and socket files, a client its reply socket) and ``grace_s`` in all to exit;
        whatever still runs is killed."""
        procs = [*self.engines.values(), self.coordinator]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
            if proc.stdout is not None:
                proc.stdout.close()
