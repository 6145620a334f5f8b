"""What log-probs cost a run: the main job on workload A with CUDA graphs, greedy and sampled,
plain, with ``--return-log-probs`` and with top-5 log-probs, each a fresh process (its own
startup warm-up), interleaved so that drift hits every option alike. Prints one markdown table:
output tok/s, decode step ms, tok/s against the first option (plain) on the same workload,
and the startup warm-up (seconds, graphs captured).
``full-variant`` (``--min-tokens 1``: no token changes, no log-probs) replays graph_plan.py's
FULL graphs (penalties and every filter stage), which a decode step asking for log-probs does
not replay (it replays its own variant's log-prob twin): what that variant alone costs.

    python -m benchmarks log-prob-cost [--out DIR] [--default-model qwen3-8b] [--repeats 2]
    python -m benchmarks log-prob-cost --options plain log-probs      # a subset
    python -m benchmarks log-prob-cost --smoke          # CPU, tiny model, seconds (no graphs)
    python -m benchmarks log-prob-cost --in-process --repeats 5   # one engine, cells interleaved

``--in-process`` runs every cell on ONE engine (one startup, the same captured graphs, the same
device state), each workload run once untimed first, then the cells interleaved ``--repeats``
times: process-to-process spread (a few %, more than the cost asked about) drops out; decode ms
is the mean decode step of each run alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.commands.main_job_vs_benchmark import ROOT, run, sampling_flags, workload_flags

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
    p.add_argument("--in-process", action="store_true", help="every cell on one engine in this process")
    args = p.parse_args(argv)
    if args.in_process:
        return in_process(args)
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


def in_process(args) -> list[dict]:
    """The cells on one engine (see the module doc): median tok/s and decode ms per cell."""
    import copy

    from megatron_async.cli import flags as cli
    from megatron_async.cli.driver import run_workload
    from megatron_async.cli.main_job import build_parser, build_workload, load_llm, parse_args

    flags = workload_flags(args.smoke) + (["--device", "cpu"] if args.smoke else ["--cuda-graphs"])
    if args.default_model:
        flags += ["--default-model", args.default_model]
    base = parse_args(build_parser("log-prob cost"), [*flags, "--ignore-eos", "--quiet"])
    cli.resolve_device_args(base)
    llm = load_llm(base, stream_text=False)  # as the main job
    requests = build_workload(llm, base)
    cells = {}
    for wl in ("greedy", "sampled"):
        for opt in args.options:
            cell = parse_args(build_parser("log-prob cost"), [*flags, *sampling_flags(wl), *OPTIONS[opt],
                                                                "--ignore-eos", "--quiet"])
            cli.resolve_device_args(cell)
            cells[(wl, opt)] = cli.sampling_factory(cell)
    results: dict[tuple[str, str], list[tuple[float, float, int]]] = {k: [] for k in cells}
    stats = llm.engine.stats

    def timed(make) -> tuple[float, float, int]:
        """(tok/s, decode ms, answers that came with log-probs: the cell asked what it says)."""
        wall0, steps0 = stats.decode_wall_time, stats.decode_steps
        run = run_workload(llm.engine, copy.deepcopy(requests), make)
        decode = 1e3 * (stats.decode_wall_time - wall0) / max(1, stats.decode_steps - steps0)
        with_log_probs = sum(o is not None and o.generated_log_probs is not None for o in run.outputs)
        return run.output_tokens / run.wall_time, decode, with_log_probs

    for wl in ("greedy", "sampled"):  # untimed: every variant's kernels built, graphs replayed once
        for opt in args.options:
            timed(cells[(wl, opt)])
    for _ in range(args.repeats):
        for key, make in cells.items():
            results[key].append(timed(make))
    llm.close()
    rows = []
    print(f"\n| workload | option | out tok/s | decode ms | tok/s vs first | decode vs first |  (one engine, "
          f"{args.repeats} runs per cell interleaved, median; {args.default_model or 'default model'})")
    print("|---|---|---:|---:|---:|---:|")
    for wl in ("greedy", "sampled"):
        first = results[(wl, args.options[0])]
        base_tok, base_ms = statistics.median(r[0] for r in first), statistics.median(r[1] for r in first)
        for opt in args.options:
            tok = statistics.median(r[0] for r in results[(wl, opt)])
            ms = statistics.median(r[1] for r in results[(wl, opt)])
            rows.append({"workload": wl, "option": opt, "tok_s": tok, "decode_ms": ms,
                         "runs": results[(wl, opt)]})
            print(f"| {wl} | {opt} | {tok:,.0f} | {ms:.3f} | {100 * (tok / base_tok - 1):+.1f} % "
                  f"| {100 * (ms / base_ms - 1):+.1f} % |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "log_prob_cost_in_process.json").write_text(json.dumps(rows, indent=1))
    return rows


def _warmup(stats: dict) -> dict:
    return {"warmup_seconds": stats.get("warmup_seconds") or 0.0, "warmup_graphs": stats.get("warmup_graphs") or 0}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
