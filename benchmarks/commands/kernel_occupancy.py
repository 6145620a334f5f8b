"""Every Triton kernel an engine compiled, as the device got it: warps, stages, registers a thread,
spills, shared memory, the register cap asked for, and the programs an SM holds at once
(``launch_limits.resident_programs``: by registers, shared memory and threads), for each built-in
model and quantization given, each engine in its own process.

A tile table that launches k programs an SM so that one hides another's latency gets that only
where the SM holds k; the compiler's register count decides it and no CPU test can see it (the FP8
grouped experts asked for two and got one: 185 registers a thread). The engine runs its warm-up
(every CUDA-graph shape compiled) and a few prompts of 100-1,024 tokens, then the kernels are read
from Triton's caches.

    python -m benchmarks kernel-occupancy [--models qwen3-0.6b qwen3-30b-a3b] [--quantization fp8]
    python -m benchmarks kernel-occupancy --spills-only

CUDA only. Prints one table last: one row per (kernel, launch settings), the models that compiled it."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks kernel-occupancy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b"], help="built-in models")
    p.add_argument("--quantization", choices=["fp8"], default=None, help="FP8 weights for every model")
    p.add_argument("--prompts", type=int, default=24, help="prompts of 100-1,024 tokens run after the warm-up")
    p.add_argument("--spills-only", action="store_true", help="list only kernels that spill registers")
    return p.parse_args(argv)


def print_table(found: dict[tuple, set[str]], spills_only: bool) -> None:
    import torch

    from megatron_async.kernels import launch_limits

    limits = launch_limits.device_limits(torch.device("cuda"))
    print("\n| kernel | warps | stages | registers | spills | shared KB | cap | programs an SM | models |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for (name, warps, stages, regs, spills, shared, cap), models in sorted(found.items()):
        if spills_only and not spills:
            continue
        held = launch_limits.resident_programs(warps, regs, shared, limits)
        print(f"| {name} | {warps} | {stages} | {regs} | {spills} | {shared / 1024:.1f} | {cap or '-'} | {held} | "
              f"{', '.join(sorted(models))} |")


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from benchmarks.kernel_occupancy import one_model
    from benchmarks.own_process import in_own_process

    if not torch.cuda.is_available():
        sys.exit("kernel-occupancy reads compiled GPU kernels: no CUDA device")
    found: dict[tuple, set[str]] = {}
    for model in args.models:
        tag = model + (f" {args.quantization}" if args.quantization else "")
        for row in in_own_process("cuda", one_model, model, args.quantization, args.prompts):
            found.setdefault(row, set()).add(tag)
    print_table(found, args.spills_only)
    return found


if __name__ == "__main__":
    main()
