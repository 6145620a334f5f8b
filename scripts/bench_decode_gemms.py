#!/usr/bin/env python
"""The decode GEMMs of the built-in qwen3-0.6b shape, alone, inside CUDA graphs: device time
per call of ``F.linear`` (cuBLAS, the engine's path before the skinny kernel), the
batch-invariant Triton matmul, and the skinny split-K Triton matmul (its default tiles and,
with ``--sweep``, the best of a tile grid), then one decode step's GEMM sequence (28 layers of
qkv, o_proj, gate_up + SiLU-mul, down, then the LM head) both ways.

Every measurement cycles through 28 distinct weights per shape (as the 28 layers do), so the
weights come from DRAM, not from L2 as they would if one weight were called 50 times.

    python scripts/bench_decode_gemms.py --rows 64 128 256 [--sweep]"""
from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
import torch.nn.functional as F

from megatron_async.kernels.linear import _invariant_linear
from megatron_async.kernels.triton_act import silu_and_mul
from megatron_async.kernels.triton_skinny_matmul import SkinnyConfig, skinny_config, skinny_linear
from megatron_async.tools.cuda_timing import capture as capture_out, graph_replay
from megatron_async.tools.roofline import measure_copy_bandwidth

LAYERS = 28
# cuBLAS (+ the SiLU-mul kernel); skinny with its default tiles, with the sweep's best, and the
# default tiles launched with programmatic dependent launch (1: wait at the start and let the
# next kernel launch; 2: also prefetch the weight slab into L2 before waiting)
KINDS = ("cublas", "default", "best", "pdl1", "pdl2")
SHAPES = {  # name: (weight rows, in features K, gated), qwen3-0.6b
    "qkv": (4096, 1024, False), "o_proj": (1024, 2048, False), "gate_up": (6144, 1024, True),
    "down": (1024, 3072, False), "lm_head": (151936, 1024, False),
}


def graph_time_us(fns, calls_per_graph: int, replays: int = 5) -> float:
    """Device time per call: ``fns`` (a cycle of calls) captured in one graph, replayed, event-timed."""
    replay = graph_replay(lambda: [fns[i % len(fns)]() for i in range(calls_per_graph)])
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls_per_graph * replays)


def reference(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    return silu_and_mul(F.linear(x, w)) if gated else F.linear(x, w)


def sweep_configs(m: int):
    bms = sorted({min(64, max(16, m)), min(128, max(16, m))})
    for bm, bn, bk, split in itertools.product(bms, (16, 32, 64), (64, 128), (1, 2, 4, 8)):
        if bm * bn > 128 * 64:
            continue
        yield SkinnyConfig(bm, bn, bk, split, 8 if bm * bn >= 128 * 64 else 4, 4 if bk == 64 or bm <= 64 else 3)


def check_pdl_chain(length: int = 112) -> None:
    """A chain where every GEMM reads the one before (o_proj and down shapes in turn, the
    gated gate_up between them), in a graph with PDL 0 / 1 / 2: all three must give the same
    bits, or a kernel read its input before the kernel that writes it had finished."""
    torch.manual_seed(1)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
          for n, k in [(2048, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] * (length // 4)]
    x0 = torch.randn(128, 1024, device="cuda", dtype=torch.bfloat16)
    outs = []
    for pdl in (0, 1, 2):
        def chain(pdl=pdl):
            x = x0
            for w in ws:
                gated = w.shape[0] == 6144
                cfg = dataclasses.replace(skinny_config(128, w.shape[0] // (2 if gated else 1), w.shape[1], gated,
                                                        x.device), pdl=pdl)
                x = skinny_linear(x, w, None, gated, cfg)
            return x
        outs.append(chain())
        g, out = capture_out(chain)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        outs.append(out.clone())
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    print(f"PDL chain of {length} dependent GEMMs, eager and graph, pdl 0/1/2: {'same bits' if same else 'DIFFERENT'}")
    assert same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--sweep", action="store_true", help="time a grid of skinny tiles per shape at each row count")
    args = p.parse_args()
    check_pdl_chain()
    torch.manual_seed(0)
    bw = measure_copy_bandwidth(torch.device("cuda")) / 1e9  # GB/s, as the benchmark's floor uses
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:,.0f} GB/s; bf16; us per call (GB/s of weight read)")
    inv = _invariant_linear()
    weights = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                      for _ in range(1 if name == "lm_head" else LAYERS)] for name, (n, k, _) in SHAPES.items()}
    best: dict[tuple[str, int], tuple[float, SkinnyConfig]] = {}
    print("| GEMM | rows | floor us | cuBLAS (+SiLU-mul) | Triton invariant | skinny default | default tiles |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, (n, k, gated) in SHAPES.items():
        ws = weights[name]
        floor = n * k * 2 / bw / 1e3
        calls = len(ws) * (1 if name == "lm_head" else 2)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = reference(x, ws[0], gated)
            err = (skinny_linear(x, ws[0], None, gated).float() - ref.float()).abs().max().item()
            assert err <= 2e-2 * ref.float().abs().max().item() + 1e-3, (name, m, err)
            cols = [graph_time_us([lambda w=w: reference(x, w, gated) for w in ws], calls),
                    graph_time_us([lambda w=w: inv(x, w, None) for w in ws], calls),
                    graph_time_us([lambda w=w: skinny_linear(x, w, None, gated) for w in ws], calls)]
            out_n = n // 2 if gated else n
            cfg = skinny_config(m, out_n, k, gated, x.device)
            print(f"| {name} | {m} | {floor:.1f} | " + " | ".join(f"{us:.1f} ({n * k * 2 / us / 1e3:,.0f})" for us in cols)
                  + f" | {cfg.block_m}x{cfg.block_n}x{cfg.block_k} split {cfg.split_k} |")
            best[(name, m)] = (cols[2], cfg)
            if not args.sweep or name == "lm_head":
                continue
            results = []
            for c in sweep_configs(m):
                try:
                    y = skinny_linear(x, ws[0], None, gated, c)
                    if (y.float() - ref.float()).abs().max().item() > 2e-2 * ref.float().abs().max().item() + 1e-3:
                        print(f"  WRONG {c}")
                        continue
                    results.append((graph_time_us([lambda w=w: skinny_linear(x, w, None, gated, c) for w in ws], calls), c))
                except Exception as e:  # out of shared memory / registers: skip the tile
                    print(f"  skip {c}: {type(e).__name__}")
            results.sort(key=lambda r: r[0])
            for us, c in results[:4]:
                print(f"  sweep {name} m={m}: {us:.1f} us  {c}")
            if results and results[0][0] < best[(name, m)][0]:
                best[(name, m)] = results[0]

    print(f"\nper decode step ({LAYERS} layers x qkv, o_proj, gate_up + SiLU-mul, down; then the LM head), us:")
    print("| rows | floor | " + " | ".join(KINDS) + " |\n|---:|---:|" + "---:|" * len(KINDS))
    floor = sum(n * k * 2 * len(weights[name]) for name, (n, k, _) in SHAPES.items()) / bw / 1e3
    for m in args.rows:
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (_, k, _) in SHAPES.items()}

        def step(kind: str) -> None:
            for layer in range(LAYERS):
                for name in ("qkv", "o_proj", "gate_up", "down"):
                    w, gated, x = weights[name][layer], SHAPES[name][2], xs[name]
                    if kind == "cublas":
                        reference(x, w, gated)
                    else:
                        cfg = skinny_config(m, w.shape[0] // (2 if gated else 1), w.shape[1], gated, x.device)
                        cfg = best[(name, m)][1] if kind == "best" else cfg
                        cfg = dataclasses.replace(cfg, pdl=int(kind[-1])) if kind.startswith("pdl") else cfg
                        skinny_linear(x, w, None, gated, cfg)
            F.linear(xs["lm_head"], weights["lm_head"][0])

        cells = [graph_time_us([lambda kind=kind: step(kind)], 1, replays=20) for kind in KINDS]
        print(f"| {m} | {floor:.0f} | " + " | ".join(f"{us:.0f}" for us in cells) + " |")


if __name__ == "__main__":
    main()
