#!/usr/bin/env python
"""Profile N decode steps of the engine, serial vs async: chrome traces (open in
https://ui.perfetto.dev or chrome://tracing) plus the GPU idle share of each window.

    python scripts/profile_step.py --steps 100 --batch 64            # traces in profile_out/
    nsys profile -t cuda,nvtx -o decode python scripts/profile_step.py --nvtx --no-torch-profiler
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from megatron_async import LLM
from megatron_async.tools import cli
from megatron_async.tools.gpu_idle import profile_decode_steps

MODES = {"serial": {"async_scheduling": False, "cuda_graphs": False},
         "async": {"async_scheduling": True, "cuda_graphs": False},
         "async_graphs": {"async_scheduling": True, "cuda_graphs": True}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cli.add_model_args(p)
    cli.add_engine_args(p, mode_flags=False)
    p.add_argument("--modes", default="serial,async", help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--batch", type=int, default=32, help="decode rows")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=50, help="decode steps profiled")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-only", action="store_true", help="record device activity only (less profiler overhead)")
    p.add_argument("--no-torch-profiler", action="store_true", help="no torch.profiler (run under nsys instead)")
    p.add_argument("--output-dir", default="profile_out")
    args = p.parse_args(argv)
    cli.resolve_device_args(args)
    out = Path(args.output_dir)
    report = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in MODES:
            p.error(f"unknown mode {mode!r}")
        cfg = cli.inference_config_from_args(args, **MODES[mode])
        llm = LLM(args.model, args.device, args.dtype, cfg, default_model=args.default_model)
        trace = None if args.no_torch_profiler else out / f"trace_{mode}.json"
        prof = profile_decode_steps(llm.engine, args.batch, args.prompt_len, args.steps, args.warmup_steps, trace,
                                    record_cpu=not args.cuda_only, use_profiler=not args.no_torch_profiler, seed=args.seed)
        report[mode] = asdict(prof)
        idle = "n/a" if prof.idle_share is None else f"{prof.idle_share:.1%}"
        print(f"{mode:>12}: batch {prof.batch}, {prof.steps} steps ({prof.decode_only_steps} decode-only), "
              f"{prof.host_ms_per_step:.2f} ms/step host, GPU idle {idle}" + (f", trace {trace}" if trace else ""))
        del llm
    if not args.no_torch_profiler:
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.json").write_text(json.dumps(report, indent=1))
        print(f"wrote {out / 'profile.json'}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
