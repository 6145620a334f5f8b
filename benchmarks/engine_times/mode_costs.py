"""What each mode costs on one workload (GPU): workload A (128 requests, prompts 100-1,024, 128
outputs), sampled (temperature 0.8, top-p 0.95) and greedy, async + CUDA graphs, each mode in its
own process on the same seeded weights: the default; batch-invariant; n-gram speculation (k 3,
the default adaptive policy); log-probs of every generated token; prefix caching on (this workload
shares no prefix: its bookkeeping cost alone); FP8 weights; FP8 weights and FP8 KV. Prints output
tok/s, the ratio to the default, mean decode / prefill step and the decode batch.

    python -m benchmarks engine-times mode-costs [--workloads sampled] [--modes default,fp8]
    python -m benchmarks engine-times mode-costs --smoke   # CPU, tiny model, no graphs: plumbing only"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from benchmarks.engine_times.batch_invariance import SAMPLING, setup, timed_run
from benchmarks.own_process import in_own_process
from megatron_async.cli.workload import WorkloadRequest, WorkloadSpec, synthetic_workload
from megatron_async.config.modes import SpeculativeMethod
from megatron_async.models.default_model import DEFAULT_CONFIGS

# mode -> (InferenceConfig fields, LLM quantization, SamplingParams fields)
MODES = {
    "default": ({}, None, {}),
    "batch_invariant": ({"batch_invariant": True}, None, {}),
    "ngram_speculation": ({"num_speculative_tokens": 3, "speculative_method": SpeculativeMethod.NGRAM}, None, {}),
    "log_probs": ({}, None, {"return_log_probs": True}),
    "prefix_caching": ({"enable_prefix_caching": True}, None, {}),
    "fp8": ({}, "fp8", {}),
    "fp8_kv": ({"kv_cache_dtype": "fp8_e4m3"}, "fp8", {}),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="sampled,greedy", help="comma-separated: greedy, sampled")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(DEFAULT_CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 3 short requests, no graphs (plumbing)")
    p.add_argument("--no-graphs", action="store_true", help="eager async instead of async + CUDA graphs")


def run_mode(args, requests: list[WorkloadRequest], sampling: str, mode: str) -> dict:
    fields, quantization, extra = MODES[mode]

    def make(r):
        return dataclasses.replace(SAMPLING[sampling](r), **extra)
    llm, _, numbers = timed_run(args, requests, make, 4, quantization, **fields)
    llm.close()
    return {"sampling": sampling, "mode": mode, **numbers}


def run(args: argparse.Namespace) -> None:
    setup(args)  # --smoke: the CPU, the tiny model, Triton's interpreter (batch-invariant mode's kernels)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("mode-costs measures GPU throughput: no CUDA device (--smoke runs on CPU)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = sorted(set(modes) - set(MODES)) + sorted(set(workloads) - set(SAMPLING))
    if bad or not modes or not workloads:
        sys.exit(f"unknown modes or workloads: {bad}; modes: {', '.join(MODES)}; workloads: {', '.join(SAMPLING)}")
    if args.smoke:  # FP8 needs a GPU's e4m3 GEMMs or the interpreter: the smoke run leaves it out
        modes = [m for m in modes if not m.startswith("fp8")]
    spec = WorkloadSpec(3, 4, 12, 4, 4, 0.0, args.seed) if args.smoke else WorkloadSpec(128, 100, 1024, 128, 128, 0.0,
                                                                                          args.seed)
    requests = synthetic_workload(spec, DEFAULT_CONFIGS[args.model]["vocab_size"])
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}, built-in {args.model}; {spec.num_requests} requests, prompts {spec.prompt_len_min}-"
          f"{spec.prompt_len_max}, {spec.output_len_max} outputs; each mode in its own process", file=sys.stderr)
    rows = []
    for sampling in workloads:
        for mode in modes:
            print(f"  {sampling} {mode} ...", file=sys.stderr)
            rows.append(in_own_process(args.device, run_mode, args, requests, sampling, mode))
    print("| sampling | mode | out tok/s | x default | decode ms | prefill ms | decode batch |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        base = next((b for b in rows if b["sampling"] == r["sampling"] and b["mode"] == "default"), r)
        print(f"| {r['sampling']} | {r['mode']} | {r['tok_s']:,.0f} | {r['tok_s'] / base['tok_s']:.2f} | "
              f"{r['decode_ms']:.2f} | {r['prefill_ms']:.1f} | {r['batch']:.1f} |")
    failed = sum(r["failed"] for r in rows)
    if failed:
        print(f"{failed} requests failed")
        sys.exit(1)
