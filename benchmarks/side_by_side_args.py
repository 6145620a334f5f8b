"""The side-by-side benchmark's modes, workloads and command line (benchmarks/side_by_side.py runs
them): which engine settings each mode stands for, the sampled workload's settings, the flags and
their checks, and ``--smoke``'s small values."""
from __future__ import annotations

import argparse
import sys

from benchmarks import hf_peers
from benchmarks.bench_report import HF_PEERS
from megatron_async import InferenceConfig
from megatron_async.cli import flags

DESCRIPTION = "Side-by-side benchmark: one workload, one set of weights, several modes in one process."
WORKLOADS = {"greedy": hf_peers.Sampling(), "sampled": hf_peers.Sampling(temperature=0.8, top_p=0.95)}
"""Sampled: temperature 0.8 + top-p 0.95, each request seeded (seed + its index) in the engine."""
ENGINE_MODES = {
    "serial": {"async_scheduling": False, "cuda_graphs": False},
    "async": {"async_scheduling": True, "cuda_graphs": False},
    "serial_graphs": {"async_scheduling": False, "cuda_graphs": True},
    "async_graphs": {"async_scheduling": True, "cuda_graphs": True},
    # async + graphs with eager mixed steps (decode graphs only), the comparison for mixed-step graphs
    "async_graphs_decode": {"async_scheduling": True, "cuda_graphs": True, "cuda_graph_mixed_steps": False},
}
MODES = (*HF_PEERS, *ENGINE_MODES)
DEFAULT_MODES = tuple(m for m in MODES if m != "async_graphs_decode")
SMOKE = {"device": "cpu", "default_model": "tiny", "num_requests": 8, "prompt_len_min": 8, "prompt_len_max": 32,
         "output_len_min": 8, "output_len_max": 16, "max_requests": 4, "buffer_size_gb": 0.05, "max_minutes": 5.0,
         "warmup_requests": 2}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=flags.HelpFormatter)
    flags.add_model_args(p)
    flags.add_engine_args(p, mode_flags=False)
    g = p.add_argument_group("benchmark")
    g.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    g.add_argument("--num-requests", type=int, default=256)
    g.add_argument("--prompt-len-min", type=int, default=100)
    g.add_argument("--prompt-len-max", type=int, default=1024)
    g.add_argument("--output-len-min", type=int, default=100)
    g.add_argument("--output-len-max", type=int, default=1024)
    g.add_argument("--workloads", default="greedy,sampled", help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    g.add_argument("--request-rate", type=float, default=0.0,
                   help="Poisson arrivals in requests per second of wall clock (0 = all at once)")
    g.add_argument("--hf-batch-size", type=int, default=None, help="HF generate batch size (default: --max-requests)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--warmup-requests", type=int, default=None,
                   help="requests of the twin warm-up workload every side runs first (default: all)")
    g.add_argument("--no-twin-warmup", action="store_true",
                   help="engine modes: time right after the engine's own startup warm-up, without the twin run")
    g.add_argument("--no-idle-profile", action="store_true",
                   help="skip the profiled second run that gives the device idle shares (CUDA)")
    g.add_argument("--repeats", type=int, default=1,
                   help="timed runs per engine mode and workload, on the same engine: the table shows the median "
                        "run (by tok/s; the slower middle one for an even count) and the tok/s range, the spread "
                        "within one engine (use an odd count; engines of the same code differ more, so an A/B "
                        "between two trees takes python -m benchmarks ab)")
    g.add_argument("--max-minutes", type=float, default=30.0, help="stop starting/continuing modes after this")
    g.add_argument("--output-dir", default="benchmark_out", help="benchmark.json and step_times.png go here")
    g.add_argument("--smoke", action="store_true", help="tiny model, few requests, CPU: seconds")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)  # smoke values replace defaults, never flags given explicitly
    args = p.parse_args(argv)
    flags.resolve_device_args(args)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        p.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    defaults = InferenceConfig()
    args.max_requests = args.max_requests or defaults.max_requests
    args.max_tokens = args.max_tokens or max(defaults.max_tokens, args.max_requests)
    args.hf_batch_size = args.hf_batch_size or args.max_requests
    return args
