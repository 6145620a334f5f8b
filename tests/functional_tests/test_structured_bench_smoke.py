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
    (checked inside), the baseline's requests copy one template and the other's one per thread."""
    from benchmarks.commands import grammar_fill

    rows = grammar_fill.main(["--rows", "4", "--threads", "2", "--steps", "3", "--repeats", "1",
                              "--backends", "guidance"])
    assert [(r["configuration"], r["templates"]) for r in rows] == [
        ("llguidance, one template, 2 threads", 1), ("llguidance, template per thread, 2 threads", 2)]
    assert all(r["ms"] > 0 for r in rows)
