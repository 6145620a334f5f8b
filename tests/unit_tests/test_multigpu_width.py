"""``--multigpu-width`` (tests/conftest.py) splits the multigpu suite between its two halves
(scripts/multigpu_validation.sh): every test lands in exactly one, the ones that use more than two
GPUs (``gpus(4)``, ``gpus(2, up_to=4)``) in ``wide``; the real test files carry those marks."""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "functional_tests").glob("test_multigpu_*.py"))


class _Item(SimpleNamespace):
    def get_closest_marker(self, name):
        return self.marks.get(name)

    def add_marker(self, mark):
        self.added.append(mark)


def _items():
    gpus = {"pair": None, "four": pytest.mark.gpus(4).mark, "up_to_four": pytest.mark.gpus(2, up_to=4).mark,
            "six": pytest.mark.gpus(6).mark}
    items = [_Item(name=n, keywords={"multigpu": True}, marks={"gpus": m} if m else {}, added=[])
             for n, m in gpus.items()]
    return items + [_Item(name="cpu", keywords={}, marks={}, added=[])]


def _select(width):
    items, dropped = _items(), []
    config = SimpleNamespace(getoption=lambda _: width,
                             hook=SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
    pytest_collection_modifyitems(config, items)
    return {i.name for i in items}, {i.name for i in dropped}


def test_the_two_widths_split_the_suite():
    wide, wide_dropped = _select("wide")
    pair, pair_dropped = _select("pair")
    assert wide == {"four", "up_to_four", "six", "cpu"} and wide_dropped == {"pair"}
    assert pair == {"pair", "cpu"} and pair_dropped == {"four", "up_to_four", "six"}
    assert {n.name for n in _items()} == _select(None)[0]  # no width: everything


def test_the_test_files_mark_their_wide_tests():
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-o", "addopts=", "-m", "multigpu", "--multigpu-width", "wide", *FILES],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    wide = {line for line in run.stdout.splitlines() if "::" in line}
    assert "tests/functional_tests/test_multigpu_ep.py::test_fp32_ep_tokens_equal_ep1[4-True]" in wide
    assert "tests/functional_tests/test_multigpu_ep.py::test_fp32_ep_tokens_equal_ep1[2-True]" not in wide
    assert "tests/functional_tests/test_multigpu_p2p_all_reduce.py::test_p2p_all_reduce_equals_nccl" in wide
    assert "tests/functional_tests/test_multigpu_tp.py::test_fp32_tp_tokens_equal_tp1[qwen3-4]" in wide
    assert not any("test_multigpu_speculative" in t for t in wide)
    assert any("test_multigpu_weight_ipc_per_rank" in t for t in wide)
