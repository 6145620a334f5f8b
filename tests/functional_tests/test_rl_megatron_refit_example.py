"""examples/rl_megatron_refit.py on CPU: trainer processes (Megatron-Core TP 2 where megatron-core is
installed, else the HF model sent in Megatron-Core's layout) send weights over a gloo transfer group
or shared-memory IPC handles after each optimizer step; the engine's log-probs equal the trainer's
forward (fp32) and every token carries its step's weight version. A trainer whose replicated
weights drift between its TP ranks (q / k norm gradients not summed) is caught."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.requirements import installed

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rl_megatron_refit.py"
HAS_MEGATRON = installed("megatron.core", "einops")


def _run(script: Path, *args: str) -> subprocess.CompletedProcess:
    """The example's run, its output through files: a trainer sharing CPU tensors starts
    torch_shm_manager, which inherits the example's stdout / stderr and holds pipes open for seconds
    after the example exited (a pipe's reader would wait for it)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, stdout=out, stderr=err, text=True,
                              timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


@pytest.mark.parametrize("args", [  # each trainer with one transport (both transports with both: by hand)
    ["--trainer", "hf", "--transport", "ipc", "--trainer-tp", "1"],
    pytest.param(["--trainer", "megatron", "--transport", "distributed"],
                 marks=pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core not installed")),
])
def test_example_checks_pass(args):
    proc = _run(EXAMPLE, *args, "--steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2 and all(row.rstrip(" |").endswith("ok") for row in rows)
    assert max(float(row.split("|")[2]) for row in rows) <= 2e-5


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core not installed")
def test_example_fails_when_trainer_ranks_drift(tmp_path):
    broken = tmp_path / "rl_megatron_refit.py"
    source = EXAMPLE.read_text().replace('name.endswith(("q_layernorm.weight", "k_layernorm.weight"))', "False")
    assert source != EXAMPLE.read_text()
    broken.write_text(source)
    (tmp_path / "megatron_gpt.py").write_text((ROOT / "examples" / "megatron_gpt.py").read_text())
    proc = _run(broken, "--trainer", "megatron", "--steps", "2")
    assert proc.returncode == 1 and "FAILED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
