"""python -m benchmarks moe-ep --smoke: EP=1 and EP=2 (gloo) through the same workload on the CPU,
greedy and sampled; float32, so EP=2's tokens equal EP=1's for every request."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "commands"


def test_bench_moe_ep_smoke(capsys):
    sys.path.insert(0, str(SCRIPTS))  # spawned ranks import the script module by name (sys.path travels)
    try:
        bench = importlib.import_module("moe_ep")
        rows = bench.main(["--smoke"])
    finally:
        sys.path.remove(str(SCRIPTS))
    assert [(r["ep"], r["workload"]) for r in rows] == [(1, "greedy"), (1, "sampled"), (2, "greedy"), (2, "sampled")]
    for r in rows:
        assert r["tok_s"] > 0 and r["equal"] == r["n"] == 6, r
    ep2 = [r for r in rows if r["ep"] == 2]
    assert all(len(r["dummy"]) == 2 and len(r["consensus_us"]) == 2 for r in ep2)
    out = capsys.readouterr().out
    assert "| EP | workload | output tok/s | vs EP=1 |" in out and "| 2 | sampled |" in out
