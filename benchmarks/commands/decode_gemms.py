#!/usr/bin/env python
"""The decode GEMMs of the built-in qwen3-0.6b shape (``--shapes``: Qwen3-8B's, whole or one TP rank's), alone, inside CUDA graphs: device time
per call of ``F.linear`` (cuBLAS; gate_up followed by the SiLU-mul kernel, the model's path
before the fused gate_up + SwiGLU kernel, which ``python -m benchmarks kernel-times swiglu-matmul`` compares with it)
and of the batch-invariant Triton matmul, then one decode step's GEMM sequence (28 layers of
qkv, o_proj, gate_up + SiLU-mul, down, then the LM head) against its weight-read floor.

Every measurement cycles through one distinct weight per layer and shape (as the layers do), so the
weights come from DRAM, not from L2 as they would if one weight were called 50 times. A
split-K Triton matmul with the SwiGLU epilogue and programmatic dependent launch was tried
against these numbers and removed (no gain). ``--libraries``: the layer GEMMs alone under cuBLAS,
under cuBLASLt (``torch.backends.cuda.preferred_blas_library``) and after PyTorch's TunableOp tuned
each shape, instead. ``--read-floor``: what a kernel that only reads each weight takes (its best
grid), beside cuBLAS and the split output projection, and an empty kernel's cost in a chain: the
part of a GEMM's time that no GEMM can remove. ``--profile-range``: each of those kernels once (and the
fused gate_up + SwiGLU) between cudaProfilerStart / Stop, for Nsight Compute's DRAM / L2 counters.

    python -m benchmarks decode-gemms --rows 64 128 256 [--libraries | --read-floor] [--shapes qwen3-8b-tp4]
    python -m benchmarks decode-gemms --gemv --shapes qwen3-8b-tp4     # one row: cuBLAS against the GEMV's tiles
    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum,\
lts__t_sectors.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python -m benchmarks decode-gemms --rows 128 --profile-range"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.cuda_timing import graph_call_us
from benchmarks.roofline import measure_copy_bandwidth
from megatron_async.kernels import triton_split_linear
from megatron_async.kernels.linear_op import _invariant_linear
from megatron_async.kernels.triton_act import silu_and_mul

LAYERS = 28
SHAPES = {  # name: (weight rows, in features K, gated), qwen3-0.6b
    "qkv": (4096, 1024, False), "o_proj": (1024, 2048, False), "gate_up": (6144, 1024, True),
    "down": (1024, 3072, False), "lm_head": (151936, 1024, False),
}


def qwen3_8b(tp: int) -> dict:
    """Qwen3-8B's GEMMs (hidden 4,096, 32 / 8 heads of 128, MLP 12,288) as one of ``tp`` ranks holds them."""
    return {"qkv": ((32 + 16) * 128 // tp, 4096, False), "o_proj": (4096, 4096 // tp, False),
            "gate_up": (2 * 12288 // tp, 4096, True), "down": (4096, 12288 // tp, False),
            "lm_head": (151936 // tp, 4096, False)}


SHAPE_SETS = {"qwen3-0.6b": (LAYERS, SHAPES), "qwen3-8b": (36, qwen3_8b(1)), "qwen3-8b-tp2": (36, qwen3_8b(2)),
              "qwen3-8b-tp4": (36, qwen3_8b(4))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="qwen3-0.6b",
                   help="the model's GEMM shapes (qwen3-8b-tp4: one rank's shards at TP=4)")
    p.add_argument("--libraries", action="store_true", help="only the layer GEMMs under cuBLAS / cuBLASLt / TunableOp")
    p.add_argument("--read-floor", action="store_true", help="only a weight read alone beside the GEMMs")
    p.add_argument("--profile-range", action="store_true", help="each layer kernel once inside a profiler range (ncu)")
    p.add_argument("--gemv", action="store_true", help="only one row's projections: cuBLAS against the GEMV's tiles")
    args = p.parse_args()
    global LAYERS, SHAPES
    LAYERS, SHAPES = SHAPE_SETS[args.shapes]
    torch.manual_seed(0)
    bw = measure_copy_bandwidth(torch.device("cuda")) / 1e9  # GB/s, as the benchmark's floor uses
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:,.0f} GB/s; bf16; us per call (GB/s of weight read)")
    weights = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                      for _ in range(1 if name == "lm_head" else LAYERS)] for name, (n, k, _) in SHAPES.items()}
    if args.libraries:
        return libraries(weights, args.rows, bw)
    if args.read_floor:
        return read_floor(weights, args.rows, bw)
    if args.profile_range:
        return profile_range(weights, args.rows[0])
    if args.gemv:
        return gemv_sweep(weights)
    inv = _invariant_linear()
    print("| GEMM | rows | floor us | cuBLAS (+SiLU-mul) | Triton invariant |\n|---|---:|---:|---:|---:|")
    for name, (n, k, gated) in SHAPES.items():
        ws = weights[name]
        calls = len(ws) * (1 if name == "lm_head" else 2)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            assert torch.allclose(inv(x, ws[0], None), ref, atol=2e-2, rtol=2e-2)
            cols = [graph_call_us([lambda w=w: silu_and_mul(F.linear(x, w)) if gated else F.linear(x, w) for w in ws], calls),
                    graph_call_us([lambda w=w: inv(x, w, None) for w in ws], calls)]
            print(f"| {name} | {m} | {n * k * 2 / bw / 1e3:.1f} | "
                  + " | ".join(f"{us:.1f} ({n * k * 2 / us / 1e3:,.0f})" for us in cols) + " |")

    print(f"\nper decode step ({LAYERS} layers x qkv, o_proj, gate_up + SiLU-mul, down; then the LM head), us:")
    print("| rows | floor | cuBLAS | Triton invariant |\n|---:|---:|---:|---:|")
    floor = sum(n * k * 2 * len(weights[name]) for name, (n, k, _) in SHAPES.items()) / bw / 1e3
    for m in args.rows:
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (_, k, _) in SHAPES.items()}

        def step(mm) -> None:
            for layer in range(LAYERS):
                for name in ("qkv", "o_proj", "gate_up", "down"):
                    y = mm(xs[name], weights[name][layer])
                    if SHAPES[name][2]:
                        silu_and_mul(y)
            mm(xs["lm_head"], weights["lm_head"][0])

        cells = [graph_call_us([lambda mm=mm: step(mm)], 1, replays=20) for mm in (F.linear, lambda x, w: inv(x, w, None))]
        print(f"| {m} | {floor:.0f} | " + " | ".join(f"{us:.0f}" for us in cells) + " |")


def linear_us(x: torch.Tensor, ws: list) -> float:
    """``F.linear`` of x by each of ``ws`` in turn, twice round, in one graph: us a call."""
    return graph_call_us([lambda w=w: F.linear(x, w) for w in ws], 2 * len(ws))


def libraries(weights: dict, rows: list[int], bw: float) -> None:
    """The layer GEMMs (``F.linear`` alone) under cuBLAS, cuBLASLt and TunableOp's tuned choice."""
    from torch.cuda import tunable

    cases = {(name, m): (torch.randn(m, SHAPES[name][1], device="cuda", dtype=torch.bfloat16), weights[name])
             for name in ("qkv", "o_proj", "gate_up", "down") for m in rows}

    times = {key: [linear_us(*case)] for key, case in cases.items()}
    torch.backends.cuda.preferred_blas_library("cublaslt")
    for key, case in cases.items():
        times[key].append(linear_us(*case))
    torch.backends.cuda.preferred_blas_library("cublas")
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_filename(f"/tmp/decode_gemms_tunableop_{os.getpid()}.csv")
    try:
        for x, ws in cases.values():
            F.linear(x, ws[0])  # tuned here, eagerly, before any capture
        torch.cuda.synchronize()
        tunable.tuning_enable(False)
        for key, case in cases.items():
            times[key].append(linear_us(*case))
        chosen = sorted({r[2] for r in tunable.get_results()})
    finally:
        tunable.enable(False)
    print(f"TunableOp's choices: {', '.join(chosen)}")
    print("| GEMM | rows | weight MB | floor us | cuBLAS | cuBLASLt | TunableOp |\n|---|---:|---:|---:|---:|---:|---:|")
    for (name, m), cells in times.items():
        n, k, _ = SHAPES[name]
        print(f"| {name} | {m} | {n * k * 2 / 1e6:.1f} | {n * k * 2 / bw / 1e3:.1f} | "
              + " | ".join(f"{c:.1f}" for c in cells) + " |")


@triton.jit
def _read_kernel(w_ptr, out_ptr, n_per, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * n_per
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n_per, BLOCK):
        acc += tl.load(w_ptr + base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 0.0)


def read_floor(weights: dict, rows: list[int], bw: float) -> None:
    """Per layer GEMM: a kernel that reads the weight and nothing else (sums it; the fastest of
    128-2,048 programs x 512-2,048-element loads), cuBLAS, and the split output projection (its
    partials, without the norm that sums them) at ``rows``; then an empty kernel's cost per call in
    a chain of 56 (the launch alone)."""
    out = torch.empty(4096, device="cuda")
    print("| GEMM | weight MB | floor us | read alone us | rows | cuBLAS | split |\n|---|---:|---:|---:|---:|---:|---:|")
    for name in ("qkv", "o_proj", "gate_up", "down"):
        ws, (n, k, _) = weights[name], SHAPES[name]
        reads = []
        for programs in (128, 256, 512, 1024, 2048):
            for block in (512, 1024, 2048):
                if (n * k) % (programs * block) == 0:
                    per = n * k // programs
                    reads.append(graph_call_us([lambda w=w, p=programs, b=block, e=per: _read_kernel[(p,)](w, out, e, BLOCK=b)
                                                for w in ws], 2 * len(ws)))
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = linear_us(x, ws)
            split = (graph_call_us([lambda w=w: triton_split_linear.split_linear(x, w).parts for w in ws], 2 * len(ws))
                     if triton_split_linear.takes(x, ws[0], None) else None)
            print(f"| {name} | {n * k * 2 / 1e6:.1f} | {n * k * 2 / bw / 1e3:.1f} | {min(reads):.1f} | {m} | {cublas:.1f} | "
                  + ("-" if split is None else f"{split:.1f}") + " |")
    for programs in (1, 132, 1056):
        us = graph_call_us([lambda p=programs: _empty_kernel[(p,)](out)], 56)
        print(f"empty kernel, {programs} programs: {us:.2f} us a call in a chain of 56")


def gemv_sweep(weights: dict) -> None:
    """At one row, each projection the split path takes: cuBLAS against the CUDA-core GEMV's four
    K-split partials (``triton_gemv``) on its default tiles and on each of 8 / 16 rows x 256 / 512
    wide steps x 4 / 8 warps (the fastest marked)."""
    from megatron_async.kernels.triton_gemv import GemvTiles, gemv_parts, gemv_tiles

    cands = [GemvTiles(bn, bk, w) for bn in (8, 16) for bk in (256, 512) for w in (4, 8)]
    print("| GEMM | N x K | cuBLAS | GEMV default (tiles) | fastest GEMV (tiles) |\n|---|---|---:|---:|---:|")
    for name in ("qkv", "o_proj", "down"):
        ws, (n, k, _) = weights[name], SHAPES[name]
        if k % (4 * 256):
            continue
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        us = {t: graph_call_us([lambda w=w, t=t: gemv_parts(x, w, 4, t) for w in ws], 2 * len(ws)) for t in cands}
        best, default = min(us, key=us.get), gemv_tiles(n, k, 4)
        print(f"| {name} | {n} x {k} | {linear_us(x, ws):.1f} | {us[default]:.1f} {tuple(default)} | "
              f"{us[best]:.1f} {tuple(best)} |")


def profile_range(weights: dict, m: int) -> None:
    """Each layer GEMM at ``m`` rows once under cuBLAS, the split output projections, the fused
    gate_up + SwiGLU and the read-alone kernel (512 programs of 1,024-element loads), run once
    before to compile and pick algorithms, then once inside cudaProfilerStart / Stop in the
    printed order (Nsight Compute's ``--profile-from-start off`` counts only those)."""
    from megatron_async.kernels.triton_swiglu_matmul import swiglu_linear

    names = ("qkv", "o_proj", "gate_up", "down")
    w = {name: weights[name][0] for name in names}
    x = {name: torch.randn(m, SHAPES[name][1], device="cuda", dtype=torch.bfloat16) for name in names}
    out = torch.empty(4096, device="cuda")
    calls = [(f"cuBLAS {n}", lambda n=n: F.linear(x[n], w[n])) for n in names]
    calls += [(f"split {n}", lambda n=n: triton_split_linear.split_linear(x[n], w[n]).parts)
              for n in names if triton_split_linear.takes(x[n], w[n], None)]
    calls += [("fused gate_up + SwiGLU", lambda: swiglu_linear(x["gate_up"], w["gate_up"]))]
    calls += [(f"read {n}", lambda n=n: _read_kernel[(512,)](w[n], out, w[n].numel() // 512, BLOCK=1024))
              for n in names]
    for _, fn in calls:
        fn()
    torch.cuda.synchronize()
    print(f"{m} rows, profiled in this order: " + ", ".join(name for name, _ in calls))
    torch.cuda.profiler.start()
    for _, fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
