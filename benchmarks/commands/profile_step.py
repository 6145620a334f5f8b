#!/usr/bin/env python
"""Profile a decode-heavy run of the engine per mode: the device idle share of the whole run and
of its decode-only launch windows, from CUPTI intervals (see benchmarks/gpu_idle.py),
plus the chrome traces (open in https://ui.perfetto.dev). CUDA only for the idle shares.

    python -m benchmarks profile-step --batch 64 --steps 100          # traces in profile_out/
    python -m benchmarks profile-step --modes async,async_graphs --temperature 0.8 --top-p 0.95
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks.gpu_idle import profile_run
from megatron_async import LLM, SamplingParams
from megatron_async.cli import flags
from megatron_async.cli.driver import run_workload
from megatron_async.cli.workload import WorkloadRequest, twin_workload

MODES = {"serial": {"async_scheduling": False, "cuda_graphs": False},
         "async": {"async_scheduling": True, "cuda_graphs": False},
         "async_graphs": {"async_scheduling": True, "cuda_graphs": True}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags.add_model_args(p)
    flags.add_engine_args(p, mode_flags=False)
    p.add_argument("--modes", default="serial,async", help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--batch", type=int, default=32, help="requests, all arriving at once")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=50, help="output tokens per request (decode steps)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="profile_out")
    args = p.parse_args(argv)
    flags.resolve_device_args(args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in MODES:
            p.error(f"unknown mode {mode!r}")
        llm = LLM(args.model, args.device, args.dtype, flags.inference_config_from_args(args, **MODES[mode]),
                  default_model=args.default_model, quantization=args.quantization)
        rng = np.random.default_rng(args.seed)
        reqs = [WorkloadRequest(rng.integers(0, llm.model.vocab_size, size=args.prompt_len).tolist(), args.steps)
                for _ in range(args.batch)]

        def params(r: WorkloadRequest, i=iter(range(1 << 30))) -> SamplingParams:
            greedy = args.temperature <= 0
            return SamplingParams(temperature=args.temperature if not greedy else 1.0, top_k=1 if greedy else 0,
                                  top_p=args.top_p, seed=args.seed + next(i), num_tokens_to_generate=r.output_len,
                                  ignore_eos=True)

        if llm.runner.graphs is not None:
            llm.runner.graphs.warmup()
        run_workload(llm.engine, twin_workload(reqs, llm.model.vocab_size, args.seed), params)  # compiles, captures
        trace = out / f"trace_{mode}.json"
        run, idle = profile_run(llm.engine, lambda: run_workload(llm.engine, reqs, params), str(trace))
        report[mode] = {"output_tokens_per_s": run.output_tokens / run.wall_time, "steps": len(run.steps),
                        "decode_steps": sum(s.decode_only for s in run.steps), "idle": asdict(idle) if idle else None}
        share = "n/a (no device timeline)" if idle is None else (
            f"run {idle.run_idle_share:.1%}, decode windows "
            + ("n/a" if idle.decode_idle_share is None else f"{idle.decode_idle_share:.1%}"))
        print(f"{mode:>12}: batch {args.batch}, {len(run.steps)} steps, {report[mode]['output_tokens_per_s']:,.0f} "
              f"tok/s (profiled), device idle {share}" + (f", trace {trace}" if idle else ""))
        del llm
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'profile.json'}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
