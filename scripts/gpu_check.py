#!/usr/bin/env python
"""GPU checks of the kernels and of the engine's CUDA paths, one subcommand each: outputs against
the torch reference (or the engine against itself: graphs == eager, speculative == plain) first,
then times. Each exits non-zero when its check fails. The bodies live in scripts/gpu_checks/.

    python scripts/gpu_check.py                          # the list of subcommands
    python scripts/gpu_check.py paged-attention --help
    python scripts/gpu_check.py fused-moe --tokens 1 8 128
"""
from pathlib import Path

from _subcommands import dispatch

if __name__ == "__main__":
    dispatch(Path(__file__).resolve().parent / "gpu_checks", "python scripts/gpu_check.py")
