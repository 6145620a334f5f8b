"""Run the server as a child process on a free loopback port (tests, the load test script)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections import deque

_READY = re.compile(r"megatron_async\.serve: serving (\S+) on (https?://\S+)")


class ServerProcess:
    """``with ServerProcess(["--model", ckpt]) as srv: srv.url ...`` starts
    ``python -m megatron_async.serve ARGS --port 0`` and waits for its ready line."""

    def __init__(self, args: list[str], host: str = "127.0.0.1", start_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, launcher: list[str] | None = None, log_path: str | None = None):
        """``launcher``: runs ``-m megatron_async.serve ARGS`` (default: this Python), e.g.
        ``["torchrun", "--standalone", "--nproc-per-node", "2"]`` for tensor parallelism.
        ``log_path``: every line the server prints is also written there."""
        self.log_path = log_path
        self.launcher = launcher or [sys.executable]
        self.args = [*args, "--host", host, "--port", "0"]
        self.start_timeout_s = start_timeout_s
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.model_name = ""
        self._lines: deque[str] = deque(maxlen=200)

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen([*self.launcher, "-m", "megatron_async.serve", *self.args], env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        ready = threading.Event()

        log = open(self.log_path, "a") if self.log_path else None

        def pump():  # keep reading so the child never blocks on a full pipe
            for line in self.proc.stdout:
                self._lines.append(line.rstrip("\n"))
                if log is not None:
                    log.write(line)
                    log.flush()
                m = _READY.search(line)
                if m and not ready.is_set():
                    self.model_name, self.url = m.group(1), m.group(2)
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.start_timeout_s
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start (exit {self.proc.returncode}):\n{self.output()}")
        return self

    def output(self) -> str:
        """The last lines the server printed."""
        return "\n".join(self._lines)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
