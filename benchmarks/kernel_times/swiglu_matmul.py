"""The SwiGLU MLP's gate_up projection + activation: cuBLAS ``F.linear`` followed by the SiLU-mul
kernel against the fused Triton kernel (``triton_swiglu_matmul``; the MLP takes whichever measured
faster at the row count, ``pays_off``), qwen3-0.6b shape (I = 3,072, K = 1,024), bf16, at decode
and prefill row counts: us per call in CUDA graphs cycling through 28 distinct weights (weights
from DRAM, as in a step); ``--sweep`` times every tile setting that fits shared memory. ``--act
relu2``: NemotronH's up projection + relu(h)^2 instead (``--inter 4096`` for the hybrid shape;
cuBLAS + ``relu_square`` the unfused side). The error line first is for orientation: the assertions
are tests/unit_tests/kernels/test_swiglu_matmul.py's.

    python -m benchmarks kernel-times swiglu-matmul [--rows 128 1024 8192] [--sweep] [--inter 3072 --hidden 1024]
    python -m benchmarks kernel-times swiglu-matmul --act relu2 --inter 4096 [--sweep]"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.cuda_timing import graph_call_us
from megatron_async.kernels.triton_act import relu_square, silu_and_mul
from megatron_async.kernels.triton_swiglu_matmul import ActTiles, act_tiles, relu2_linear, swiglu_linear

LAYERS = 28


def sweep_tiles(gated: bool) -> list[ActTiles]:
    out = []
    widths = (64, 128) if gated else (32, 64, 128, 256)
    for bm, bn, bk, warps, stages in itertools.product((64, 128), widths, (64, 128), (4, 8), (3, 4)):
        smem = stages * (bm * bk + (2 if gated else 1) * bn * bk) * 2 + bm * bn * 2  # pipeline + the store's tile
        if smem <= 224 * 1024:
            out.append(ActTiles(bm, bn, bk, warps, stages))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--inter", type=int, default=3072)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--sweep", action="store_true", help="time every tile setting that fits shared memory")
    p.add_argument("--act", choices=("swiglu", "relu2"), default="swiglu",
                   help="relu2: an up projection + relu(h)^2 (NemotronH) instead of gate_up + SwiGLU")


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    gated = args.act == "swiglu"
    n, k = (2 if gated else 1) * args.inter, args.hidden
    fused_fn, act_fn = (swiglu_linear, silu_and_mul) if gated else (relu2_linear, relu_square)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.03 for _ in range(LAYERS)]
    print(f"{'gate_up' if gated else 'up'} {n} x {k} bf16; us per call in a graph (TFLOP/s of the GEMM)")

    # fp32 (exact operands, tf32 off) and bf16 against F.linear + the SiLU-mul kernel
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(777, k, device=dev, dtype=dtype)
        w = ws[0].to(dtype)
        ref = act_fn(F.linear(x, w))
        got = fused_fn(x, w)
        err = ((got.float() - ref.float()).abs() / (ref.float().abs() + 1e-2)).max().item()
        print(f"777 rows {dtype}: max |fused - ref| / (|ref| + 1e-2) {err:.2e}")

    print(f"| rows | cuBLAS | + {'SiLU-mul' if gated else 'relu^2'} | fused (default tiles) | best fused (tiles) |")
    print("|---:|---:|---:|---:|---|")
    for m in args.rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        flop = 2 * m * n * k
        calls = 2 * LAYERS

        def cell(us: float) -> str:
            return f"{us:.1f} ({flop / us / 1e6:,.0f})"

        gemm = graph_call_us([lambda w=w: F.linear(x, w) for w in ws], calls)
        ref = graph_call_us([lambda w=w: act_fn(F.linear(x, w)) for w in ws], calls)
        fused = graph_call_us([lambda w=w: fused_fn(x, w) for w in ws], calls)
        best = ""
        if args.sweep:
            timed = []
            for t in sweep_tiles(gated):
                try:
                    timed.append((graph_call_us([lambda w=w, t=t: fused_fn(x, w, tiles=t) for w in ws], calls), t))
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                    print(f"  skip {t}: {type(e).__name__}")
            timed.sort(key=lambda r: r[0])
            for us, t in timed[:5]:
                print(f"  rows {m}: {us:.1f} us {t}")
            us, t = timed[0]
            best = f"{cell(us)} ({t.block_m}x{t.block_n}x{t.block_k}, w{t.num_warps} s{t.num_stages})"
        d = act_tiles(m, torch.bfloat16, dev, gated)
        print(f"| {m} | {cell(gemm)} | {cell(ref)} | {cell(fused)} [{d.block_m}x{d.block_n}x{d.block_k}] | {best} |",
              flush=True)

