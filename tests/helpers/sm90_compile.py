"""Compiling the package's Triton kernels ahead of time for an H100 (sm_90) with the installed Triton,
on any machine: the interpreter tests cannot see a compile failure. The script runs in a subprocess
without TRITON_INTERPRET (the suite sets it on CPU machines, and interpreted kernels cannot be
compiled); where this Triton has no CUDA backend (or no ptxas) the test is skipped.

One such subprocess per test process serves every compile test it runs, each script in fresh globals
(starting Python with torch and Triton costs ~2 s a time on a small CPU; the compiles are what differ)."""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = r'''
import json, sys
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", 90, 32)
except ImportError as e:
    print(json.dumps({"skip": str(e)})); sys.exit(0)

def compile_asm(fn, sig, consts, attrs=None, **options):
    """The kernel's asm (ptx, cubin, ...) for sm_90; reports a skip and exits without a CUDA backend."""
    try:
        return triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=options).asm
    except (KeyError, FileNotFoundError) as e:  # no CUDA backend / ptxas in this Triton
        print(json.dumps({"skip": f"{type(e).__name__}: {e}"})); sys.exit(0)
'''
"""Defines ``target`` and ``compile_asm`` for the script that follows; the script prints its results
as one JSON line last."""


_SERVER = r'''
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")  # the answers' own descriptor: fd 1 now goes where fd 2 does, so
os.dup2(2, 1)                         # what a compiler or a child process writes there cannot break a line
for line in sys.stdin:
    source, out, err, code = json.loads(line), io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(source, "<compile script>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    answers.write(json.dumps({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n")
    answers.flush()
'''
"""Runs each JSON-encoded script it reads (a line) as ``python -c`` would, and answers with its exit
code and output (a line)."""

_server: subprocess.Popen | None = None


def _run_script(source: str, timeout: float) -> dict:
    """``source`` run in this test process's compile subprocess (started at its first script)."""
    global _server
    if _server is None or _server.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        log = tempfile.TemporaryFile("w+")  # (a pipe nobody reads could fill)
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=log, text=True, env=env)
        _server.log = log
        atexit.register(_server.kill)
    server = _server
    server.stdin.write(json.dumps(source) + "\n")
    server.stdin.flush()
    deadline = time.monotonic() + timeout
    while not select.select([server.stdout], [], [], 0.5)[0]:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            _server = None
            raise AssertionError(f"the compile subprocess died or took over {timeout} s: {_log_tail(server)}")
    line = server.stdout.readline()
    if not line:
        _server = None
        raise AssertionError(f"the compile subprocess died: {_log_tail(server)}")
    return json.loads(line)


def _log_tail(server: subprocess.Popen) -> str:
    server.log.seek(0)
    return server.log.read()[-3000:]


def compile_results(script: str, timeout: float) -> dict:
    """Run ``PRELUDE + script`` in a subprocess and return its last line's JSON (skips the test where
    Triton cannot compile for CUDA)."""
    run = _run_script(PRELUDE + script, timeout)
    assert run["returncode"] == 0, run["stderr"][-3000:]
    out = json.loads(run["stdout"].strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"Triton cannot compile for CUDA here: {out['skip']}")
    return out
