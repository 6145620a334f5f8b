#!/usr/bin/env python
"""The decode GEMMs of the built-in qwen3-0.6b shape, alone, inside CUDA graphs (no launch
gaps): per-call device time and weight-read bandwidth of ``F.linear`` (the engine's path), of
the same product with the weight stored transposed (``x @ W_t``), and of the batch-invariant
Triton matmul, at decode row counts. Decode at batch 128 spends ~0.86 ms per step in these
GEMMs against a ~0.36 ms weight-read floor (profile_decode_kernels.py); this says whether the
gap is the library's kernel choice, the weight layout, or inherent at these sizes.

    python scripts/bench_decode_gemms.py --rows 1 32 128 256"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from megatron_async.kernels.linear import _invariant_linear
from megatron_async.tools.cuda_timing import graph_replay
from megatron_async.tools.roofline import measure_copy_bandwidth

SHAPES = {  # name: (out features N, in features K), qwen3-0.6b
    "qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
    "lm_head": (151936, 1024),
}


def graph_time_us(fn, calls: int = 50, replays: int = 5) -> float:
    """Device time per call: ``calls`` calls captured in one graph, replayed, event-timed."""
    replay = graph_replay(lambda: [fn() for _ in range(calls)])
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 256])
    args = p.parse_args()
    torch.manual_seed(0)
    bw = measure_copy_bandwidth(torch.device("cuda")) / 1e9  # GB/s, as the benchmark's floor uses
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:,.0f} GB/s; bf16; us per call (GB/s of weight read)")
    inv = _invariant_linear()
    totals: dict[tuple[int, str], float] = {}
    print("| GEMM | rows | floor us | F.linear | x @ W_t | Triton invariant |\n|---|---:|---:|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wt = w.t().contiguous()
        floor = w.numel() * 2 / bw / 1e3
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            assert torch.allclose(x @ wt, ref, atol=2e-2, rtol=2e-2) and torch.allclose(inv(x, w, None), ref, atol=2e-2,
                                                                                          rtol=2e-2)
            cells = []
            for label, fn in (("linear", lambda: F.linear(x, w)), ("wt", lambda: x @ wt), ("inv", lambda: inv(x, w, None))):
                us = graph_time_us(fn)
                totals[(m, label)] = totals.get((m, label), 0.0) + us * (1 if name == "lm_head" else 28)
                cells.append(f"{us:.1f} ({w.numel() * 2 / us / 1e3:,.0f})")
            totals[(m, "floor")] = totals.get((m, "floor"), 0.0) + floor * (1 if name == "lm_head" else 28)
            print(f"| {name} | {m} | {floor:.1f} | " + " | ".join(cells) + " |")
    print("\nper decode step (28 layers x 4 GEMMs + LM head), us:")
    print("| rows | floor | F.linear | x @ W_t | Triton invariant |\n|---:|---:|---:|---:|---:|")
    for m in args.rows:
        print(f"| {m} | {totals[(m, 'floor')]:.0f} | {totals[(m, 'linear')]:.0f} | {totals[(m, 'wt')]:.0f} | "
              f"{totals[(m, 'inv')]:.0f} |")


if __name__ == "__main__":
    main()
