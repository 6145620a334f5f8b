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
