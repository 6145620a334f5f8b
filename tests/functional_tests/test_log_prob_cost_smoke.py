"""python -m benchmarks log-prob-cost --in-process --smoke on the CPU: every cell ran on one engine,
interleaved, and each asked what its name says (log-probs only where the option asks for them)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "commands" / "log_prob_cost.py"


def test_in_process_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its sibling main_job_vs_benchmark
    spec = importlib.util.spec_from_file_location("log_prob_cost", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--in-process", "--smoke", "--repeats", "2", "--options", "plain", "log-probs",
                     "--out", str(tmp_path)])
    assert [(r["workload"], r["option"]) for r in rows] == [
        ("greedy", "plain"), ("greedy", "log-probs"), ("sampled", "plain"), ("sampled", "log-probs")]
    for r in rows:
        assert len(r["runs"]) == 2 and all(tok > 0 and ms > 0 for tok, ms, _ in r["runs"])
        answered = {n for _, _, n in r["runs"]}
        assert answered == ({0} if r["option"] == "plain" else {6})  # the smoke workload's 6 requests
    assert "| greedy | log-probs |" in capsys.readouterr().out
    assert (tmp_path / "log_prob_cost_in_process.json").is_file()
