#!/usr/bin/env python
"""A/B of two trees of the package with the side-by-side benchmark, each run in a fresh process,
the sides interleaved (before, after, after, before, ...) so slow drift hits both alike.

Why: on the GPUs two engines of the same code differ by more than most single changes (workload
A's mixed steps by +-0.4 ms, ~2 % of tok/s, between processes), while runs inside one engine
agree to ~0.3 % (``--repeats``). One engine per side says little about a 1-3 % change; medians
over several processes per side do.

    mkdir -p ab/before && git archive COMMIT megatron_async | tar -x -C ab/before
    python -m benchmarks ab --before ab/before --rounds 3 -- \\
        --modes async_graphs --num-requests 128 --output-len-min 128 --output-len-max 128 \\
        --max-requests 128 --no-twin-warmup --no-idle-profile

``--before`` / ``--after`` are directories holding a ``megatron_async`` package (``--after``
defaults to this repository). The arguments after ``--`` go to every benchmark run (not
``--output-dir``: each run writes under ``--output-dir``/SIDE/rN). Prints, per mode, workload
and metric, both sides' medians and every run, and after / before; ``ab.json`` keeps all of it.
Exits 1 if any run failed."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METRICS = {"output_tokens_per_s": "tok/s", "mean_decode_step_ms": "decode ms", "mean_mixed_step_ms": "mixed ms",
           "step_over_floor": "decode / floor", "mixed_over_floor": "mixed / floor", "ttft_p50_ms": "TTFT p50 ms",
           "first_step_end_ms": "first step ends, ms"}
_RUNNER = ("import os, sys; sys.path[:0] = [os.environ['AB_ROOT'], os.environ['AB_BENCHMARKS']]; import megatron_async; "
           "print('ab: package', megatron_async.__file__, file=sys.stderr); "
           "from benchmarks.side_by_side import main; main(sys.argv[1:])")
"""Both sides run this tree's benchmark code against their own package (which must have ``megatron_async/cli/``)."""


def run_side(root: Path, bench_args: list[str], out_dir: Path) -> list[dict]:
    """One benchmark process on ``root``'s package; its per-(mode, workload) rows (benchmark.json)."""
    env = dict(os.environ, AB_ROOT=str(root.resolve()), AB_BENCHMARKS=str(ROOT))
    cmd = [sys.executable, "-c", _RUNNER, *bench_args, "--output-dir", str(out_dir)]
    done = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "log.txt").write_text(done.stdout + done.stderr)
    report = out_dir / "benchmark.json"
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"benchmark on {root} failed (rc {done.returncode}); log: {out_dir / 'log.txt'}\n"
                           f"{(done.stdout + done.stderr)[-2000:]}")
    rows = json.loads(report.read_text())["modes"]
    for row in rows:  # nested / derived numbers as plain metrics
        row["ttft_p50_ms"] = (row.get("latency_ms") or {}).get("ttft_p50_ms")
        steps = row.get("step_times") or []
        row["first_step_end_ms"] = 1e3 * steps[0][0] if steps else None
    return rows


def summarize(runs: dict[str, list[list[dict]]]) -> list[dict]:
    """Per (mode, workload, metric): every run's value per side, medians, after / before."""
    rows = []
    keys = sorted({(m["mode"], m["workload"]) for side in runs.values() for run in side for m in run})
    for mode, workload in keys:
        for metric, label in METRICS.items():
            values = {}
            for side, side_runs in runs.items():
                values[side] = [m[metric] for run in side_runs for m in run
                                if m["mode"] == mode and m["workload"] == workload and m.get(metric) is not None]
            if not values["before"] or not values["after"]:
                continue
            before, after = statistics.median(values["before"]), statistics.median(values["after"])
            rows.append({"mode": mode, "workload": workload, "metric": label, "before": values["before"],
                         "after": values["after"], "before_median": before, "after_median": after,
                         "after_over_before": after / before if before else None})
    return rows


def format_rows(rows: list[dict]) -> str:
    def num(x: float) -> str:
        return f"{x:,.1f}" if x >= 100 else f"{x:.3f}"

    def runs(xs: list[float]) -> str:
        return " / ".join(num(x) for x in xs)

    lines = ["| mode | workload | metric | before: median (runs) | after: median (runs) | after / before |",
             "|---|---|---|---|---|---:|"]
    for r in rows:
        ratio = "-" if r["after_over_before"] is None else f"{r['after_over_before']:.3f}"
        lines.append(f"| {r['mode']} | {r['workload']} | {r['metric']} | {num(r['before_median'])} ({runs(r['before'])}) "
                     f"| {num(r['after_median'])} ({runs(r['after'])}) | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="directory holding the 'before' megatron_async package")
    p.add_argument("--after", type=Path, default=ROOT, help="directory holding the 'after' package (default: this repo)")
    p.add_argument("--rounds", type=int, default=3, help="processes per side")
    p.add_argument("--output-dir", type=Path, default=Path("ab_out"))
    args = p.parse_args(own)
    if "--output-dir" in bench_args:
        p.error("--output-dir after '--' is set per run by this script")
    for side in (args.before, args.after):
        if not (side / "megatron_async" / "__init__.py").exists():
            p.error(f"{side} holds no megatron_async package")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    roots = {"before": args.before, "after": args.after}
    runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
    failed = []
    for r in range(args.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            print(f"round {r + 1}/{args.rounds}: {side} ...", file=sys.stderr, flush=True)
            try:
                runs[side].append(run_side(roots[side], bench_args, args.output_dir / side / f"r{r + 1}"))
            except RuntimeError as e:
                failed.append(str(e))
                print(e, file=sys.stderr)
    rows = summarize(runs) if runs["before"] and runs["after"] else []
    print(format_rows(rows))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "ab.json").write_text(json.dumps({"bench_args": bench_args, "rounds": args.rounds,
                                                         "rows": rows, "failed": failed}, indent=1))
    if failed:
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
