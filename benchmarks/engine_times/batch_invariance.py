"""Cost of batch-invariant mode on the benchmark workload (GPU). For greedy and sampled
(temperature 0.8, top-p 0.95) decoding, runs the default mode and ``batch_invariant=True`` side
by side in one process (async + CUDA graphs, the benchmark's fastest engine mode; same weights,
same workload), then re-runs a few requests of each run alone on the same engine and counts those
whose tokens equal the batch run's (both modes: the default mode shows what the invariant one
removes; the assertion for the invariant mode is tests/functional_tests/test_batch_invariant_gpu.py's).
Prints one table: output tok/s, mean decode / prefill step, ratio to the default mode.

    python -m benchmarks engine-times batch-invariance            # 256 requests, prompts 100-1024, outputs 100-1024
    python -m benchmarks engine-times batch-invariance --quick    # 128 requests, outputs 100-256
    python -m benchmarks engine-times batch-invariance --long --workloads greedy  # 32 requests, prompts 8k-16k, 64 out
    python -m benchmarks engine-times batch-invariance --smoke    # CPU (Triton interpreter), tiny model: plumbing only"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from benchmarks.own_process import in_own_process
from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.cli.driver import StatsWindow, run_workload
from megatron_async.cli.summary import summarize
from megatron_async.cli.workload import WorkloadRequest, WorkloadSpec, synthetic_workload
from megatron_async.models.default_model import DEFAULT_CONFIGS

SAMPLING = {
    "greedy": lambda r: SamplingParams(top_k=1, num_tokens_to_generate=r.output_len, ignore_eos=True),
    "sampled": lambda r: SamplingParams(temperature=0.8, top_p=0.95, num_tokens_to_generate=r.output_len,
                                        ignore_eos=True, seed=len(r.prompt)),
}
ALONE_CHECKS = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="128 requests, outputs 100-256")
    p.add_argument("--long", action="store_true",
                   help="long context: 32 requests, prompts 8,192-16,384 tokens, 64 outputs (16,448-token sequences)")
    p.add_argument("--workloads", default="greedy,sampled", help="comma-separated: greedy, sampled")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny model, 3 short requests, no graphs: checks the plumbing (interpreter: minutes)")
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(DEFAULT_CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-graphs", action="store_true", help="eager async instead of async + CUDA graphs")


def setup(args: argparse.Namespace) -> None:
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.model, args.no_graphs = "tiny", True
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        from interpreter_dot import make_interpreter_dot_row_independent

        make_interpreter_dot_row_independent()  # the interpreter's BLAS dot is not row-invariant


def timed_run(args, requests: list[WorkloadRequest], make, warm: int, quantization: str | None = None,
              **fields) -> tuple[LLM, object, dict]:
    """An engine of ``InferenceConfig(**fields)`` on the benchmark's settings (async + CUDA graphs
    unless ``--no-graphs``), warmed on ``warm`` full-length prompts (Triton kernels compile outside
    the timed run), then the workload: (the LLM, still open; the run; its row of numbers)."""
    device = torch.device(args.device)
    fields.setdefault("max_sequence_length", 2048)
    cfg = InferenceConfig(max_requests=128, max_tokens=8192, async_scheduling=True, cuda_graphs=not args.no_graphs,
                          buffer_size_gb=None if device.type == "cuda" else 0.05, seed=args.seed, **fields)
    llm = LLM(None, args.device, "bfloat16" if device.type == "cuda" else "float32", cfg, default_model=args.model,
              seed=args.seed, quantization=quantization)
    if llm.runner.graphs is not None:
        llm.runner.graphs.warmup()
    run_workload(llm.engine, [WorkloadRequest(r.prompt, 8) for r in requests[:warm]], make)
    window = StatsWindow(llm.engine)
    run = run_workload(llm.engine, requests, make)
    s = summarize(run, window.stats(), device)
    return llm, run, {"tok_s": s.output_tokens_per_s, "decode_ms": s.mean_decode_step_ms,
                      "prefill_ms": s.mean_prefill_step_ms, "batch": s.mean_decode_batch, "failed": s.failed_requests}


def run_mode(args, requests: list[WorkloadRequest], sampling: str, invariant: bool) -> dict:
    make = SAMPLING[sampling]
    llm, run, numbers = timed_run(args, requests, make, 1 if args.smoke else 4, batch_invariant=invariant,
                                  max_sequence_length=16448 if args.long else 2048)
    row = {"sampling": sampling, "mode": "batch_invariant" if invariant else "default", **numbers}
    # spot-check: requests re-run alone on the same engine vs their tokens in the batch run
    checks = min(ALONE_CHECKS, len(requests))
    same = sum(run_workload(llm.engine, [requests[i]], make).outputs[0].generated_tokens
               == run.outputs[i].generated_tokens for i in range(checks))
    row["alone"] = f"{same}/{checks}"
    llm.close()
    return row


def run(args: argparse.Namespace) -> None:
    setup(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("batch-invariance measures GPU throughput: no CUDA device (--smoke runs on CPU)")
    if args.smoke:
        spec = WorkloadSpec(3, 4, 12, 2, 4, 0.0, args.seed)
    elif args.long:
        spec = WorkloadSpec(32, 8192, 16384, 64, 64, 0.0, args.seed)
    else:
        spec = WorkloadSpec(128 if args.quick else 256, 100, 1024, 100, 256 if args.quick else 1024, 0.0, args.seed)
    requests = synthetic_workload(spec, DEFAULT_CONFIGS[args.model]["vocab_size"])
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    mode = "async" if args.no_graphs else "async + CUDA graphs"
    print(f"{name}, built-in {args.model}, {mode}; {spec.num_requests} requests, prompts "
          f"{spec.prompt_len_min}-{spec.prompt_len_max}, outputs {spec.output_len_min}-{spec.output_len_max}",
          file=sys.stderr)
    rows = []
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(SAMPLING))
    if unknown or not workloads:
        sys.exit(f"--workloads: unknown {unknown}, choose from {sorted(SAMPLING)}")
    for sampling in workloads:
        for invariant in (False, True):
            print(f"  {sampling} {'batch_invariant' if invariant else 'default'} ...", file=sys.stderr)
            rows.append(in_own_process(args.device, run_mode, args, requests, sampling, invariant))
    print(f"{'sampling':<8} {'mode':<16} {'out tok/s':>10} {'x default':>9} {'decode ms':>9} {'prefill ms':>10} "
          f"{'batch':>6} {'alone==batch':>12}")
    for r in rows:
        base = next(b for b in rows if b["sampling"] == r["sampling"] and b["mode"] == "default")
        print(f"{r['sampling']:<8} {r['mode']:<16} {r['tok_s']:>10,.0f} {r['tok_s'] / base['tok_s']:>9.2f} "
              f"{r['decode_ms']:>9.2f} {r['prefill_ms']:>10.1f} {r['batch']:>6.1f} {r['alone']:>12}")
    failed = sum(r["failed"] for r in rows)
    if failed:
        print(f"{failed} requests failed")
