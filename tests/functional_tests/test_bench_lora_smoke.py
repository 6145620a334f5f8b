"""python -m benchmarks lora --smoke on the CPU: the three engines ran on the same requests (the no-adapter engine's steps all LoRA-free), every
row of the table was measured, the adapters' engine served its adapters (counted, tokens unlike the
base model's) while the no-adapter engine named none, and the adapter loaded between two steps of a
running workload served a request afterwards."""
import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "commands" / "lora.py"
MEASURES = ["workload A greedy, out tok/s", "workload A sampled, out tok/s", "workload A greedy, decode step ms",
            "batch-1 decode, ms per step", "unload_lora, 6 running", "load_lora, 6 running"]


def test_smoke_measures_every_row_and_uses_the_adapters(tmp_path, capsys):
    out = tmp_path / "lora.json"
    main = runpy.run_path(str(SCRIPT))["main"]
    result = main(["--smoke", "--json", str(out)])
    assert json.loads(out.read_text())["checks"] == result["checks"]
    summary = result["summary"]
    assert [r["measure"].split(":")[0] for r in summary] == MEASURES
    for r in summary[:4]:
        assert all(v is not None and v > 0 for v in r["values"]), r
        assert r["idle"] > 0 and r["adapters"] > 0, r
    rows, checks = result["rows"], result["checks"]
    assert checks["adapters"]["lora_requests"] == 8 and checks["no-adapter"]["lora_requests"] == 0
    assert checks["adapters"]["first_request_differs"] and checks["adapters"]["same_tokens_as_base"] < 8
    assert checks["adapters"]["failed"] == checks["no-adapter"]["failed"] == 0
    assert rows["adapters"]["batch1"]["lora_requests"] == 1 and rows["base"]["batch1"]["lora_requests"] == 0
    for run in ("greedy", "sampled", "batch1"):  # no adapter row: every step skipped LoRA; all adapter rows: none
        assert rows["no-adapter"][run]["lora_free_steps"] == rows["no-adapter"][run]["steps"] > 0
        assert rows["adapters"][run]["lora_free_steps"] == 0
    serving = rows["adapters"]["serving"]
    assert serving["fresh_differs_from_base"]
    for op in ("unload", "load"):
        s = serving[op]
        assert s["longest_gap_ms"] > 0 and s["call_ms"] > 0 and s["step"] < serving["steps"] - 2, s
    assert set(serving["phases_ms"]) == {"unload", "install", "prepare"}
    assert serving["load"]["install_gap_ms"] <= serving["load"]["longest_gap_ms"]
    printed = capsys.readouterr().out
    assert "install phases, host ms: checks" in printed and "unload phases, host ms: users" in printed
    assert "| measure | base | lora, no adapter | lora, adapters |" in printed
    assert all(f"| {m}" in printed for m in MEASURES)
