"""python -m benchmarks speculative --smoke on the CPU: every row ran, every speculative run's
tokens equal plain decoding's, and the oracle's acceptance is what was asked."""
import json
import re

from benchmarks.bench_speculative import main


def test_smoke(tmp_path, capsys):
    out = tmp_path / "spec.json"
    rows = main(["--smoke", "--output", str(out)])
    timed = {int(b): (float(x.replace(",", "")), float(y.replace(",", ""))) for b, x, y in re.findall(
        r"plain at batch (\d+): ([\d,]+) tok/s before the speculative rows, ([\d,]+) after", capsys.readouterr().err)}
    assert timed.keys() == {1, 4}
    oracle = [r for r in rows if r.workload == "oracle" and r.policy != "plain"]
    assert {(r.batch, r.k, r.target_acceptance) for r in oracle} == {
        (b, k, a) for b in (1, 4) for k in (1, 3) for a in (0.0, 0.5, 1.0)}
    assert {r.batch for r in rows if r.policy == "plain"} == {1, 4}
    assert any(r.workload == "ngram-repetitive" for r in rows)
    assert all(r.same_tokens == 1.0 for r in rows), [r for r in rows if r.same_tokens < 1]
    for r in oracle:
        if r.target_acceptance == 1.0:
            assert r.acceptance == 1.0 and r.tokens_per_row > r.k  # k + 1, less near the length limit
        if r.target_acceptance == 0.0:
            assert r.acceptance == 0.0
    auto = [r for r in oracle if r.policy == "auto"]
    assert auto and all(r.off_rows.get("acceptance", 0) > 0 for r in auto if r.target_acceptance == 0.0)
    assert all(not r.off_rows for r in auto if r.target_acceptance == 1.0)  # every draft lands: none switched off
    for b in (1, 4):  # the oracle rows of a batch share one plain rate: the mean of its runs before and after them
        of_batch = [r for r in rows if r.batch == b and r.workload == "oracle"]
        plain = next(r for r in of_batch if r.policy == "plain")
        assert plain.tokens_per_s == plain.plain_tokens_per_s and plain.speedup == 1.0
        assert abs(plain.tokens_per_s - sum(timed[b]) / 2) <= 1.0  # the printed rates are rounded
        assert all(r.plain_tokens_per_s == plain.tokens_per_s for r in of_batch)
        assert all(abs(r.speedup - r.tokens_per_s / r.plain_tokens_per_s) < 1e-9 for r in of_batch)
    assert json.loads(out.read_text())["rows"]


def test_quick_mode():
    """--quick: the batch-128-at-0 % pair only (here the smoke's largest batch, 4), plain and the
    switch-off policy, with plain steps counted."""
    rows = main(["--smoke", "--quick"])
    assert [(r.policy, r.batch, r.k, r.target_acceptance) for r in rows] == [("plain", 4, 0, None), ("auto", 4, 3, 0.0)]
    assert rows[1].same_tokens == 1.0 and rows[1].off_rows.get("acceptance", 0) > 0 and rows[1].plain_steps > 0
