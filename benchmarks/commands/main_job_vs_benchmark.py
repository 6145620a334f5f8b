"""The main job as a user runs it against the benchmark: both reach the same numbers, with no
hidden warm-up that only the benchmark does.

Each side is a fresh process on the same workload (workload A on a GPU: 128 requests, prompts
100-1024, 128 output tokens, EOS ignored), greedy and sampled (temperature 0.8, top-p 0.95,
seeded): ``python -m benchmarks side-by-side --modes async_graphs --no-twin-warmup --no-idle-profile`` (timed
right after the engine's own startup warm-up) and ``examples/gpt_dynamic_inference.py
--cuda-graphs`` once per workload. The prompts are drawn the same way, not the same ids. Prints
one markdown table: output tok/s, decode and prefill / mixed step, and main job / benchmark.

    python -m benchmarks main-job-vs-benchmark [--out DIR]      # a GPU, ~3 minutes on an H100
    python -m benchmarks main-job-vs-benchmark --smoke          # CPU, tiny model, seconds (no graphs)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.side_by_side import WORKLOADS  # noqa: E402


def sampling_flags(workload: str) -> list[str]:
    """The main job's flags for the benchmark's own sampling of ``workload`` (one table, no copy)."""
    s = WORKLOADS[workload]
    if s.greedy:
        return ["--top-k", "1"]
    return ["--temperature", str(s.temperature), "--top-p", str(s.top_p), "--seed", "1"]


def workload_flags(smoke: bool) -> list[str]:
    if smoke:
        # the smoke's pool on both sides (a CPU engine otherwise zeroes a 1 GB pool at start)
        return ["--num-requests", "6", "--prompt-len-min", "8", "--prompt-len-max", "24", "--output-len-min", "8",
                "--output-len-max", "8", "--max-requests", "4", "--buffer-size-gb", "0.05"]
    return ["--num-requests", "128", "--prompt-len-min", "100", "--prompt-len-max", "1024", "--output-len-min", "128",
            "--output-len-max", "128", "--max-requests", "128"]


def run(cmd: list[str], log: Path, timeout: float) -> None:
    with log.open("w") as f:
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed (rc {done.returncode}): see {log}")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="main_job_vs_benchmark")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per process")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = workload_flags(args.smoke)
    device = ["--device", "cpu"] if args.smoke else ["--cuda-graphs"]
    mode = "async" if args.smoke else "async_graphs"
    run([sys.executable, "-m", "benchmarks", "side-by-side", *(["--smoke"] if args.smoke else []), *flags, "--modes", mode,
         "--no-twin-warmup", "--no-idle-profile", "--max-minutes", "3", "--output-dir", str(out / "bench")],
        out / "bench.log", args.timeout)
    bench = {m["workload"]: m for m in json.loads((out / "bench" / "benchmark.json").read_text())["modes"]
             if m["mode"] == mode and m["status"] == "ok"}
    rows = []
    for wl in WORKLOADS:
        path = out / f"main_{wl}.json"
        run([sys.executable, "examples/gpt_dynamic_inference.py", *flags, *device, *sampling_flags(wl), "--ignore-eos",
             "--quiet", "--output-path", str(path)], out / f"main_{wl}.log", args.timeout)
        s = json.loads(path.read_text())["summary"]
        b = bench[wl]
        rows.append({"workload": wl, "bench_tok_s": b["output_tokens_per_s"], "main_tok_s": s["output_tokens_per_s"],
                     "bench_decode_ms": b["mean_decode_step_ms"], "main_decode_ms": s["mean_decode_step_ms"],
                     "bench_mixed_ms": b["mean_mixed_step_ms"], "main_prefill_ms": s["mean_prefill_step_ms"]})
    print(f"| workload | benchmark ({mode}) tok/s | main job tok/s | main / benchmark | decode ms bench / main "
          "| mixed ms bench / prefill ms main |")
    print("|---|---:|---:|---:|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['bench_tok_s']:,.0f} | {r['main_tok_s']:,.0f} | "
              f"{r['main_tok_s'] / r['bench_tok_s']:.2f}x | {r['bench_decode_ms']:.2f} / {r['main_decode_ms']:.2f} | "
              f"{r['bench_mixed_ms'] or 0:.2f} / {r['main_prefill_ms'] or 0:.2f} |")
    return rows


if __name__ == "__main__":
    main()
