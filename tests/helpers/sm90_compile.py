"""Compiling the package's Triton kernels ahead of time for an H100 (sm_90) with the installed Triton,
on any machine: the interpreter tests cannot see a compile failure. The script runs in a subprocess
without TRITON_INTERPRET (the suite sets it on CPU machines, and interpreted kernels cannot be
compiled); where this Triton has no CUDA backend (or no ptxas) the test is skipped."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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


def compile_results(script: str, timeout: float) -> dict:
    """Run ``PRELUDE + script`` in a subprocess and return its last line's JSON (skips the test where
    Triton cannot compile for CUDA)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", PRELUDE + script], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"Triton cannot compile for CUDA here: {out['skip']}")
    return out
