"""What log-probs cost a run: the main job on workload A with CUDA graphs, greedy and sampled,
plain, with ``--return-log-probs`` and with top-5 log-probs, each a fresh process (its own
startup warm-up), interleaved so that drift hits every option alike. Prints one markdown table:
output tok/s, decode step ms, tok/s against the first option (plain) on the same workload,
and the startup warm-up (seconds, graphs captured).
``full-variant`` (``--min-tokens 1``: no token changes, no log-probs) replays graph_plan.py's
FULL graphs (penalties and every filter stage), which a decode step asking for log-probs does
not replay (it replays its own variant's log-prob twin): what that variant alone costs.

    python scripts/measure.py log-prob-cost [--out DIR] [--default-model qwen3-8b] [--repeats 2]
    python scripts/measure.py log-prob-cost --options plain log-probs      # a subset
    python scripts/measure.py log-prob-cost --smoke          # CPU, tiny model, seconds (no graphs)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from main_job_vs_benchmark import ROOT, run, sampling_flags, workload_flags

OPTIONS = {"plain": [], "log-probs": ["--return-log-probs"], "top-5": ["--return-log-probs", "--top-n-logprobs", "5"],
           "full-variant": ["--min-tokens", "1"]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="log_prob_cost")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--default-model", default=None, help="a built-in model other than the main job's default")
    p.add_argument("--repeats", type=int, default=1, help="processes per cell (the median is reported)")
    p.add_argument("--options", nargs="+", choices=list(OPTIONS), default=list(OPTIONS),
                   help="the first is the baseline of the last column")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per process")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = workload_flags(args.smoke) + (["--device", "cpu"] if args.smoke else ["--cuda-graphs"])
    if args.default_model:
        flags += ["--default-model", args.default_model]
    cells: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for wl in ("greedy", "sampled"):
            for opt in args.options:
                extra = OPTIONS[opt]
                path = out / f"{wl}_{opt}_{rep}.json"
                run([sys.executable, "examples/gpt_dynamic_inference.py", *flags, *sampling_flags(wl), *extra,
                     "--ignore-eos", "--quiet", "--output-path", str(path)], path.with_suffix(".log"), args.timeout)
                result = json.loads(path.read_text())
                cells.setdefault((wl, opt), []).append({**result["summary"], **_warmup(result["stats"])})
    rows = []
    model = args.default_model or "default model"
    print(f"\n| workload | option | out tok/s | decode ms | tok/s vs first | warm-up s (graphs) |  ({model}, "
          f"{args.repeats} process(es) per cell, median)")
    print("|---|---|---:|---:|---:|---:|")
    for wl in ("greedy", "sampled"):
        base = statistics.median(s["output_tokens_per_s"] for s in cells[(wl, args.options[0])])
        for opt in args.options:
            tok_s = statistics.median(s["output_tokens_per_s"] for s in cells[(wl, opt)])
            decode = statistics.median(s["mean_decode_step_ms"] or 0.0 for s in cells[(wl, opt)])
            warm = statistics.median(s["warmup_seconds"] for s in cells[(wl, opt)])
            graphs = cells[(wl, opt)][0]["warmup_graphs"]
            rows.append({"workload": wl, "option": opt, "tok_s": tok_s, "decode_ms": decode, "vs_first": tok_s / base,
                         "warmup_s": warm, "graphs": graphs})
            print(f"| {wl} | {opt} | {tok_s:,.0f} | {decode:.2f} | {100 * (tok_s / base - 1):+.1f} % "
                  f"| {warm:.1f} ({graphs}) |")
    (out / "log_prob_cost.json").write_text(json.dumps(rows, indent=1))
    return rows


def _warmup(stats: dict) -> dict:
    return {"warmup_seconds": stats.get("warmup_seconds") or 0.0, "warmup_graphs": stats.get("warmup_graphs") or 0}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
