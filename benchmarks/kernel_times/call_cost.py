"""What a decode kernel costs per call beside its bytes, at Qwen3-0.6B's shapes (H100: CUDA graphs,
inputs as a step's layers see them):

- the decode GEMMs (bf16, 64 / 128 rows, weights cycled from DRAM) under cuBLAS, under cuBLASLt
  (``torch.backends.cuda.preferred_blas_library``) and after PyTorch's TunableOp tuned each shape:
  us per call and the weight bytes' share of it at the copy bandwidth;
- the decode attention at the same programs in fewer or more waves (128 and 512 rows of 600 keys),
  one wave of long programs, and workload A's ragged rows: us per call, KV GB/s, and the cost per
  call that a straight line through two row counts puts beside the bytes.

    python -m benchmarks kernel-times call-cost [--iters 50]"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.cuda_timing import graph_call_us
from benchmarks.kernel_times.paged_attention import decode_case, graph_ms, longest_first_lens
from benchmarks.roofline import measure_copy_bandwidth
from megatron_async.kernels.triton_decode_attention import decode_attention

LINEARS = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
"""(N, K) of Qwen3-0.6B's linears."""
DRAM_BYTES = 128 << 20
"""Weight copies cycled per graph: at least this many bytes (twice the H100's 50 MB L2)."""


def gemm_rows(gbps: float) -> list[str]:
    cases = {}
    for name, (n, k) in LINEARS.items():
        copies = -(-DRAM_BYTES // (n * k * 2))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in (64, 128):
            cases[(name, m)] = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16), ws)

    def us(x: torch.Tensor, ws: list[torch.Tensor]) -> float:
        return graph_call_us([lambda w=w: F.linear(x, w) for w in ws], calls_per_graph=2 * len(ws))

    times = {key: [us(*case)] for key, case in cases.items()}
    torch.backends.cuda.preferred_blas_library("cublaslt")
    for key, case in cases.items():
        times[key].append(us(*case))
    torch.backends.cuda.preferred_blas_library("cublas")
    from torch.cuda import tunable

    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_filename("/tmp/megatron_async_call_cost_tunableop.csv")
    try:
        for x, ws in cases.values():
            F.linear(x, ws[0])  # tuned here, eagerly, before any capture
        torch.cuda.synchronize()
        tunable.tuning_enable(False)
        for key, case in cases.items():
            times[key].append(us(*case))
        kinds = sorted({r[2] for r in tunable.get_results()})
    finally:
        tunable.enable(False)
    out = [f"GEMMs (bf16, us per call; TunableOp's choices: {', '.join(kinds)})",
           "| linear | rows | weight MB | bytes at copy rate us | cuBLAS | cuBLASLt | TunableOp |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for (name, m), (a, b, c) in times.items():
        n, k = LINEARS[name]
        mb = n * k * 2 / 1e6
        out.append(f"| {name} | {m} | {mb:.1f} | {mb / gbps * 1e3:.1f} | {a:.1f} | {b:.1f} | {c:.1f} |")
    return out


def attention_rows(iters: int, gbps: float) -> list[str]:
    cases = [("128 rows x 600 keys", [600] * 128), ("512 rows x 600 keys", [600] * 512),
             ("33 rows x 4,096 keys (one wave)", [4096] * 33),
             ("workload A: 128 rows x 100-1,152 keys", longest_first_lens(128, 100, 1152))]
    out = ["decode attention (bf16 pool, 16 / 8 heads x 128, one split; 'beside bytes': us less the KV bytes'"
           " time at the copy rate)",
           "| case | us | KV GB/s | beside bytes us |", "|---|---:|---:|---:|"]
    timed = []
    for name, lens in cases:
        case, kv_bytes = decode_case(lens)
        us = graph_ms(lambda: decode_attention(case.q, case.kv_cache, case.meta, case.scale, num_splits=1), iters) * 1e3
        timed.append((us, kv_bytes))
        out.append(f"| {name} | {us:.1f} | {kv_bytes / us / 1e3:.0f} | {us - kv_bytes / gbps / 1e3:.1f} |")
        del case
    (u1, b1), (u4, b4) = timed[0], timed[1]
    rate = (b4 - b1) / (u4 - u1) / 1e3
    out.append(f"straight line through 128 and 512 rows: {rate:.0f} GB/s and {u1 - b1 / rate / 1e3:.1f} us a call")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=int, default=50)


def run(args: argparse.Namespace) -> None:
    gbps = measure_copy_bandwidth(torch.device("cuda")) / 1e9
    print(f"device copy: {gbps:.0f} GB/s")
    for line in attention_rows(args.iters, gbps) + [""] + gemm_rows(gbps):
        print(line)
