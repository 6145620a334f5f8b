#!/usr/bin/env python
"""Cost and spot-check of batch-invariant mode on the benchmark workload (GPU).

For greedy and sampled (temperature 0.8, top-p 0.95) decoding, runs the default mode and
``batch_invariant=True`` side by side in one process (async + CUDA graphs, the benchmark's
fastest engine mode; same weights, same workload), then re-runs a few requests of each
invariant run alone on the same engine and compares their tokens with the batch run.
Prints one table: output tok/s, mean decode / prefill step, ratio to the default mode.

    python scripts/check_batch_invariance.py            # 256 requests, prompts 100-1024, outputs 100-1024
    python scripts/check_batch_invariance.py --quick    # 128 requests, outputs 100-256
"""
from __future__ import annotations

import argparse
import gc
import sys

import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.models.default_model import DEFAULT_CONFIGS
from megatron_async.tools.cli import default_buffer_gb
from megatron_async.tools.driver import StatsWindow, run_workload
from megatron_async.tools.summary import summarize
from megatron_async.tools.workload import WorkloadRequest, WorkloadSpec, synthetic_workload

SAMPLING = {
    "greedy": lambda r: SamplingParams(top_k=1, num_tokens_to_generate=r.output_len, ignore_eos=True),
    "sampled": lambda r: SamplingParams(temperature=0.8, top_p=0.95, num_tokens_to_generate=r.output_len,
                                        ignore_eos=True, seed=len(r.prompt)),
}
ALONE_CHECKS = 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="128 requests, outputs 100-256")
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(DEFAULT_CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-graphs", action="store_true", help="eager async instead of async + CUDA graphs")
    return p.parse_args()


def run_mode(args, requests: list[WorkloadRequest], sampling: str, invariant: bool) -> dict:
    cfg = InferenceConfig(max_requests=128, max_tokens=8192, max_sequence_length=2048, async_scheduling=True,
                          cuda_graphs=not args.no_graphs, batch_invariant=invariant,
                          buffer_size_gb=default_buffer_gb(torch.device("cuda")), seed=args.seed)
    llm = LLM(None, "cuda", "bfloat16", cfg, default_model=args.model, seed=args.seed)
    if llm.controller.graphs is not None:
        llm.controller.graphs.warmup()
    make = SAMPLING[sampling]
    # full-length prompts first: Triton kernels compile outside the timed run
    run_workload(llm.engine, [WorkloadRequest(r.prompt, 8) for r in requests[:4]], make)
    window = StatsWindow(llm.engine)
    run = run_workload(llm.engine, requests, make)
    s = summarize(run, window.stats(), torch.device("cuda"))
    row = {"sampling": sampling, "mode": "batch_invariant" if invariant else "default",
           "tok_s": s.output_tokens_per_s, "decode_ms": s.mean_decode_step_ms, "prefill_ms": s.mean_prefill_step_ms,
           "batch": s.mean_decode_batch, "failed": s.failed_requests, "alone": ""}
    if invariant:  # spot-check: requests re-run alone on the same engine give the batch run's tokens
        same = sum(run_workload(llm.engine, [requests[i]], make).outputs[0].generated_tokens
                   == run.outputs[i].generated_tokens for i in range(ALONE_CHECKS))
        row["alone"] = f"{same}/{ALONE_CHECKS}"
    del llm, window
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("check_batch_invariance.py measures GPU throughput: no CUDA device")
    n, out_max = (128, 256) if args.quick else (256, 1024)
    spec = WorkloadSpec(n, 100, 1024, 100, out_max, 0.0, args.seed)
    requests = synthetic_workload(spec, DEFAULT_CONFIGS[args.model]["vocab_size"])
    mode = "async" if args.no_graphs else "async + CUDA graphs"
    print(f"{torch.cuda.get_device_name()}, built-in {args.model} bf16, {mode}; {n} requests, prompts 100-1024, "
          f"outputs 100-{out_max}", file=sys.stderr)
    rows = []
    for sampling in SAMPLING:
        for invariant in (False, True):
            print(f"  {sampling} {'batch_invariant' if invariant else 'default'} ...", file=sys.stderr)
            rows.append(run_mode(args, requests, sampling, invariant))
    print(f"{'sampling':<8} {'mode':<16} {'out tok/s':>10} {'x default':>9} {'decode ms':>9} {'prefill ms':>10} "
          f"{'batch':>6} {'alone==batch':>12}")
    for r in rows:
        base = next(b for b in rows if b["sampling"] == r["sampling"] and b["mode"] == "default")
        print(f"{r['sampling']:<8} {r['mode']:<16} {r['tok_s']:>10,.0f} {r['tok_s'] / base['tok_s']:>9.2f} "
              f"{r['decode_ms']:>9.2f} {r['prefill_ms']:>10.1f} {r['batch']:>6.1f} {r['alone']:>12}")
    if any(r["failed"] for r in rows):
        sys.exit("some requests failed")


if __name__ == "__main__":
    main()
