"""FP8 against bf16 on a GPU: kernel times (Qwen3-8B linears: cuBLAS bf16, the Triton W8A8 GEMM,
torch._scaled_mm; the Qwen3-30B-A3B MoE layer; decode attention over an e4m3 KV pool) and the engine
side by side (bf16, FP8 weights, FP8 weights + FP8 KV: KV tokens, batch-1 decode, workload A).

    python -m benchmarks fp8 kernels [--m 1 8 64 128 256 2048 8192] [--tokens 1 8 64 512 2048 8192]
    python -m benchmarks fp8 sweep [--m 1 16 64 128] [--models qwen3-8b qwen3-0.6b] [--family tiles|gemv|none]
    python -m benchmarks fp8 engine [--model qwen3-8b] [--configs bf16 fp8 fp8+kv] [--long]
    python -m benchmarks fp8 engine --model qwen3-30b-a3b --configs bf16 fp8+kv
    python -m benchmarks fp8 kernels --smoke; python -m benchmarks fp8 engine --smoke   # CPU: plumbing only
    python -m benchmarks fp8 sweep --smoke

Each run prints a table last (kernels: us per call in a replayed CUDA graph whose weight copies
come from DRAM, bf16 / fp8 ratio, the FP8 GEMM's weight GB/s; engine: KV tokens of the memory
plan, batch-1 ms per token, workload A tok/s and its ratio to bf16, decode and mixed steps against
their floors). Correctness is the gpu tests' (tests/unit_tests/kernels/test_fp8_gpu.py,
tests/functional_tests/test_fp8_gpu_engine.py); accuracy is ``python -m benchmarks fp8-accuracy``."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.fp8_engine_times import CONFIGS
    from megatron_async.models.default_model import DEFAULT_CONFIGS

    p = argparse.ArgumentParser(prog="python -m benchmarks fp8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    runs = p.add_subparsers(dest="run", required=True)
    k = runs.add_parser("kernels", help="kernel times, bf16 vs FP8")
    k.add_argument("--m", type=int, nargs="+", default=[1, 8, 64, 128, 256, 2048, 8192], help="linear rows")
    k.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048, 8192], help="MoE tokens")
    k.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), tiny shapes")
    s = runs.add_parser("sweep", help="the FP8 GEMM's launch settings swept at decode sizes")
    s.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 128], help="linear rows")
    s.add_argument("--models", nargs="+", default=["qwen3-8b", "qwen3-0.6b"], help="whose linears")
    s.add_argument("--budget-s", type=float, default=1e9, help="stop trying new candidates after this")
    s.add_argument("--procs", type=int, default=0, help="compiling processes (0: the cores less one)")
    s.add_argument("--family", default="tiles", choices=["tiles", "gemv", "none"],
                   help="the GEMM's tiles of each bucket, the CUDA-core kernel's settings, or none")
    s.add_argument("--json", help="write every candidate's time here")
    s.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), a tiny shape")
    e = runs.add_parser("engine", help="the engine in bf16 / FP8 weights / FP8 KV, side by side")
    e.add_argument("--model", default="qwen3-8b", choices=sorted(DEFAULT_CONFIGS))
    e.add_argument("--configs", nargs="+", default=["bf16", "fp8", "fp8+kv"], choices=list(CONFIGS))
    e.add_argument("--long", action="store_true", help="also 32 requests of 8-16k-token prompts, 64 out")
    e.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few requests: plumbing only")
    args = p.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    if args.run == "engine":
        args.max_sequence_length = 16512 if args.long else 2048
        if args.smoke:
            args.model, args.max_sequence_length = "tiny", 128
    return args


def kernels(args) -> list[dict]:
    import torch

    from benchmarks import fp8_kernel_times as kt

    device = torch.device(args.device)
    if args.smoke:
        rows = (kt.linear_rows([1, 3], device, {"tiny": (96, 200)}) + kt.moe_rows([3], device, (4, 128, 128, 2))
                + kt.attention_rows([(2, 40)], device, (4, 2, 32)))
    else:
        rows = (kt.linear_rows(args.m, device) + kt.moe_rows(args.tokens, device)
                + kt.attention_rows([(1, 16384), (32, 12288), (128, 1024)], device))
    print(f"\n{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"torch._scaled_mm block-scaled: {kt.scaled_mm_runs(device) or 'runs'}")
    kt.print_table(rows)
    return rows


def sweep(args) -> list[dict]:
    import json

    import torch

    from benchmarks import fp8_tile_sweep as ts

    device = torch.device(args.device)
    if args.smoke:
        rows = ts.sweep([1, 20], ["tiny"], device, shapes={"tiny": {"x": (96, 200)}}, limit=2)
    else:
        rows = ts.sweep(args.m, args.models, device, args.budget_s, args.procs or ts.default_procs(),
                        family=args.family)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ts.to_json(rows), f)
    ts.print_sweep(rows)
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("fp8 measures a GPU: no CUDA device (--smoke runs the plumbing on CPU)")
    if args.run == "kernels":
        return kernels(args)
    if args.run == "sweep":
        return sweep(args)
    from benchmarks import fp8_engine_times

    return fp8_engine_times.run(args)


if __name__ == "__main__":
    main()
