"""``python -m benchmarks structured --smoke``: the constrained-vs-plain cells run on the CPU, every
constrained output validates, and each plain twin generated as many tokens as its JSON cell."""
import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

from benchmarks.commands import structured  # noqa: E402


def test_smoke(tmp_path):
    rows = structured.main(["--smoke", "--repeats", "1", "--out", str(tmp_path / "cost.json")])
    assert [(r["sampling"], r["constrained"]) for r in rows] == [
        ("greedy", "100 %"), ("greedy", "10 %"), ("sampled", "100 %"), ("sampled", "10 %")]
    assert all(r["invalid"] == 0 and r["ratio"] > 0 and r["fill_ms"] > 0 for r in rows)
    assert all(r["tokens"] == r["plain_tokens"] for r in rows)
    assert (tmp_path / "cost.json").is_file()


def test_grammar_fill_runs_both_ways():
    """``python -m benchmarks grammar-fill``, tiny: every configuration fills the same masks
    (checked inside), the baseline's requests copy one template, the others' one per thread
    (given to the executor as dealt, and grouped by template) or the engine's four per thread
    (4 rows: 4 templates), the engine's also on a worker beside engine-thread Python at both
    switch intervals; the time budget stops the steps."""
    import time

    from benchmarks.commands import grammar_fill

    rows = grammar_fill.main(["--rows", "4", "--threads", "2", "--steps", "3", "--repeats", "1",
                              "--backends", "guidance", "--beside-ms", "0.5"])
    engine = "llguidance, 4 templates per thread, 2 threads"
    assert [(r["configuration"], r["templates"]) for r in rows] == [
        ("llguidance, one template, 2 threads", 1), ("llguidance, one template per thread, rows as dealt, 2 threads", 2),
        ("llguidance, one template per thread, 2 threads", 2), (engine, 4),
        (f"{engine}, beside 0.5 ms of Python, switch interval 5 ms", 4),
        (f"{engine}, beside 0.5 ms of Python, switch interval 0.1 ms", 4)]
    assert all(r["ms"] > 0 for r in rows) and all(r["ms"] >= 0.5 for r in rows[4:])
    t0 = time.perf_counter()
    grammar_fill.main(["--rows", "4", "--threads", "1", "--steps", "100000", "--repeats", "1", "--backends", "guidance",
                       "--seconds", "0.5"])
    assert time.perf_counter() - t0 < 30
