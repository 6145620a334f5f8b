"""``python -m benchmarks engine-times mode-costs --smoke``: every asked mode runs on the CPU and
gets its row (the GPU run is the measurement; this checks the plumbing and the table)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mode_costs_smoke_prints_a_row_per_mode():
    modes = ["default", "log_probs", "prefix_caching"]
    done = subprocess.run([sys.executable, "-m", "benchmarks", "engine-times", "mode-costs", "--smoke",
                           "--workloads", "greedy", "--modes", ",".join(modes)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| greedy |")]
    assert [r[1].strip() for r in rows] == modes, done.stdout
    assert rows[0][3].strip() == "1.00" and all(float(r[2].replace(",", "")) > 0 for r in rows), done.stdout
