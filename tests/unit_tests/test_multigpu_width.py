"""``--multigpu-width`` (tests/conftest.py) splits the multigpu suite between its two halves
(scripts/multigpu_validation.sh): every test lands in exactly one, the ones that use more than two
GPUs (``gpus(4)``, ``gpus(2, up_to=4)``) in ``wide``."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "functional_tests").glob("test_multigpu_*.py"))


def _collect(*args: str) -> set[str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-o", "addopts=", "-m", "multigpu", *args, *FILES],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    return {line for line in run.stdout.splitlines() if "::" in line}


def test_the_two_widths_split_the_suite():
    everything, wide, pair = _collect(), _collect("--multigpu-width", "wide"), _collect("--multigpu-width", "pair")
    assert wide | pair == everything and not wide & pair
    assert "tests/functional_tests/test_multigpu_ep.py::test_fp32_ep_tokens_equal_ep1[4-True]" in wide
    assert "tests/functional_tests/test_multigpu_ep.py::test_fp32_ep_tokens_equal_ep1[2-True]" in pair
    assert "tests/functional_tests/test_multigpu_p2p_all_reduce.py::test_p2p_all_reduce_equals_nccl" in wide
    assert any("test_multigpu_weight_ipc_per_rank" in t for t in wide)
