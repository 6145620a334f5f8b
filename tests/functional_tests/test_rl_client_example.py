"""examples/rl_client_loop.py: a trainer process drives a coordinator and two tiny engines (other
processes) through a client: GRPO groups, pause, suspend, refit by update_weights, set the
generation epoch, resume; every token carries the epoch it was generated under (the example
exits 1 otherwise: tried with set_generation_epoch doing nothing), and the refit reached the
engines."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers.coordinator_procs import ROOT, _env


def test_the_rl_client_example_runs_and_checks_every_tokens_epoch():
    # 256 blocks hold every request at once (16 of <= 48 tokens); the CPU default's 1 GB pool would be
    # zeroed at start and at each of the two resumes, in both engines
    done = subprocess.run([sys.executable, "examples/rl_client_loop.py", "--iterations", "2", "--num-prompts", "3",
                           "--num-kv-blocks", "256"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("iteration")]
    assert len(lines) == 2 and all(line.endswith("ok") for line in lines)
    assert "epochs 0 -> 10" in lines[0] and "epochs 10 -> 20" in lines[1]
