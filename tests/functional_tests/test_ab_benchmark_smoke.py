"""python -m benchmarks ab on CPU: each side's benchmark runs in its own process on its own copy
of the package (the logs name the package file each imported), and the summary pairs them."""
import json
import runpy
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ab_benchmark_runs_each_side_on_its_own_tree(tmp_path):
    pytest.importorskip("transformers")
    before = tmp_path / "before"
    shutil.copytree(ROOT / "megatron_async", before / "megatron_async", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab"
    ab = runpy.run_path(str(ROOT / "benchmarks" / "commands" / "ab.py"))
    rows = ab["main"](["--before", str(before), "--rounds", "1", "--output-dir", str(out), "--",
                       "--smoke", "--modes", "async", "--workloads", "greedy", "--num-requests", "4"])
    by_metric = {r["metric"]: r for r in rows if (r["mode"], r["workload"]) == ("async", "greedy")}
    assert set(by_metric) >= {"tok/s", "decode ms", "TTFT p50 ms", "first step ends, ms"}
    tok = by_metric["tok/s"]
    assert len(tok["before"]) == len(tok["after"]) == 1 and tok["before"][0] > 0 and tok["after"][0] > 0
    assert tok["after_over_before"] == pytest.approx(tok["after"][0] / tok["before"][0])
    assert f"ab: package {before / 'megatron_async' / '__init__.py'}" in (out / "before" / "r1" / "log.txt").read_text()
    assert f"ab: package {ROOT / 'megatron_async' / '__init__.py'}" in (out / "after" / "r1" / "log.txt").read_text()
    saved = json.loads((out / "ab.json").read_text())
    assert saved["rows"] == rows and not saved["failed"]
