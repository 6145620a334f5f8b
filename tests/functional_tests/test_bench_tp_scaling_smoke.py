"""python -m benchmarks tp-scaling --smoke: torchrun jobs of TP=1 and TP=2 on CPU (gloo, the tiny
model) through the same code the GPU run uses; every row measured, consensus recorded per step
under TP only, launch-ahead tokens equal serial ones, and the table printed."""
import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "commands" / "tp_scaling.py"


def test_smoke_measures_every_size_mode_and_batch(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    main = runpy.run_path(str(SCRIPT))["main"]
    main(["--smoke", "--json", str(out)])
    got = json.loads(out.read_text())
    assert got["missing_tp"] == [] and [r["tp"] for r in got["results"]] == [1, 2]
    for res in got["results"]:
        rows = res["rows"]
        assert {(r["backend"], r["mode"], r["batch"]) for r in rows} == {
            ("-" if res["tp"] == 1 else "gloo", mode, b) for mode in ("serial", "async") for b in (1, 4)}
        for r in rows:
            assert r["decode_ms"] > 0 and r["decode_steps"] >= 4 and r["floor_ms"] > 0, r
            assert (r["consensus_p50_us"] > 0) == (res["tp"] > 1) and r["consensus_p99_us"] >= r["consensus_p50_us"]
            assert r["async_equals_serial"] in (None, True), r
        assert res["weight_bytes"] > 0 and res["copy_bandwidth"] > 0
    printed = capsys.readouterr().out
    assert "| TP | all-reduce | mode | batch | decode ms |" in printed and "async == serial tokens in 4 of 4" in printed
