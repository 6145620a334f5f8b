"""scripts/bench_speculative.py --smoke on the CPU: every row ran, every speculative run's
tokens equal plain decoding's, and the oracle's acceptance is what was asked."""
import json

from megatron_async.tools.bench_speculative import main


def test_smoke(tmp_path):
    out = tmp_path / "spec.json"
    rows = main(["--smoke", "--output", str(out)])
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
    assert auto and all(r.off_rows.get("acceptance", 0) > 0 for r in auto)
    assert json.loads(out.read_text())["rows"]


def test_quick_mode():
    """--quick: the batch-128-at-0 % pair only (here the smoke's largest batch, 4), plain and the
    switch-off policy, with plain steps counted."""
    rows = main(["--smoke", "--quick"])
    assert [(r.policy, r.batch, r.k, r.target_acceptance) for r in rows] == [("plain", 4, 0, None), ("auto", 4, 3, 0.0)]
    assert rows[1].same_tokens == 1.0 and rows[1].off_rows.get("acceptance", 0) > 0 and rows[1].plain_steps > 0
