#!/usr/bin/env python
"""Measurements beyond the side-by-side benchmark, one subcommand each: host time per step,
consensus rounds, all-reduce and TP / EP scaling, decode GEMMs and kernels, speculative decoding,
the main job and HF decode against the engine, async against serial. The bodies live in
scripts/measurements/.

    python scripts/measure.py                            # the list of subcommands
    python scripts/measure.py host-step --rows 64 128
    python scripts/measure.py speculative --smoke
"""
from pathlib import Path

from _subcommands import dispatch

if __name__ == "__main__":
    dispatch(Path(__file__).resolve().parent / "measurements", "python scripts/measure.py")
