"""One ``torchrun --standalone`` job of a benchmark script on this host: the repository on the
ranks' path, one thread each, no model hub, NVLink multicast off in every process."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.all_reduce_checks import NO_MULTICAST_ENV

ROOT = Path(__file__).resolve().parents[1]


def run_torchrun(script: str | Path, nproc: int, argv: list[str], timeout_s: float) -> str:
    """Run ``script argv`` on ``nproc`` ranks; its end ("exit N" or "timed out") and seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script), *argv]
    env = {**os.environ, **NO_MULTICAST_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    try:
        status = f"exit {subprocess.run(cmd, env=env, timeout=timeout_s).returncode}"
    except subprocess.TimeoutExpired:
        status = "timed out"
    return f"{status} after {time.perf_counter() - t0:.0f} s"
