"""python -m benchmarks main-job-vs-benchmark --smoke on the CPU: the benchmark and the main job each ran in a
fresh process on the same workload, greedy and sampled, and the table compares them."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "commands" / "main_job_vs_benchmark.py"


def test_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("compare_main_job", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--smoke", "--out", str(tmp_path)])
    assert [r["workload"] for r in rows] == ["greedy", "sampled"]
    assert all(r["bench_tok_s"] > 0 and r["main_tok_s"] > 0 and r["main_decode_ms"] > 0 for r in rows)
    table = capsys.readouterr().out
    assert "| greedy |" in table and "| sampled |" in table
    assert (tmp_path / "main_sampled.json").is_file() and (tmp_path / "bench" / "benchmark.json").is_file()
