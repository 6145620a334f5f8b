"""Device and host time of the Triton kernels against their torch references at real shapes on
CUDA, one kernel family per argument, with their launch-setting sweeps. Tables carry an error or
same-bits column for orientation; the assertions are the ``gpu`` tests' (tests/unit_tests/kernels).

    python -m benchmarks kernel-times --help                   # the kernel families
    python -m benchmarks kernel-times paged-attention [--iters 20] [--sweep 128 100 1152]
    python -m benchmarks kernel-times prefill-attention          # prefill launches and variants, TFLOP/s
    python -m benchmarks kernel-times fused-moe --grouped-mm
    python -m benchmarks kernel-times ep-exchange --ep 2 4     # spawns one rank per GPU
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernel_times import NAMES, module  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks kernel-times", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    kernels = parser.add_subparsers(dest="kernel", required=True, metavar="KERNEL")
    for name in NAMES:
        mod = module(name)
        doc = mod.__doc__ or ""
        sub = kernels.add_parser(name, help=textwrap.shorten(doc.split("\n\n")[0], 90), description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sub)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel-times measures CUDA kernels: no CUDA device")
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", flush=True)
    module(args.kernel).run(args)


if __name__ == "__main__":
    main()
