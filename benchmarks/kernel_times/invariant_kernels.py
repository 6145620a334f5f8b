"""Batch-invariant mode's kernels at workload A's shapes (Qwen3-0.6B, bf16, H100): the invariant
matmul and fused SwiGLU (qkv, o_proj, gate_up, down, LM head) at decode and prefill row counts
with the fixed launch of ``tile_config`` against ``launch_tiles``, the path a call without tiles
takes (``triton_tma_linear`` from 1,024 rows) and cuBLAS, then the
invariant attention on a decode step (128 rows x 100-1,152 keys) and on mixed steps (2,048 /
8,192 tokens of prompts 100-1,024 plus 64 decode rows), with ``--long`` also at long context (a
prefill step of 8,192 tokens continuing 8-16k-token prompts, and 32 decode rows of 8-16k keys,
in a block table of 16,384 keys: four splits, 64-key tiles), one launch of 64-row tiles with the
compiler's register choice against the engine's launches (``launches``: a long-tile step's long
rows in 128-row tiles) and the default mode's kernels. Every variant's output is compared bit for
bit with the first launch's of its key tile (a launch may change which program computes an
element, never its bits); ``--sweep`` adds the candidate launches (tile rows, warps, registers,
stages). Times: us
per call in CUDA graphs (GEMMs cycling through 28 distinct weights, as a step's layers do).

    python -m benchmarks kernel-times invariant-kernels [--part matmul attention] [--rows 128 2048 8192] [--long]
    python -m benchmarks kernel-times invariant-kernels --sweep [--sweep-rows 128 8192]"""
from __future__ import annotations

import argparse
import dataclasses
import functools

import torch
import torch.nn.functional as F

from benchmarks.cuda_timing import graph_call_us
from benchmarks.kernel_times.paged_attention import longest_first_lens, prompt_rows
from megatron_async.kernels import attention_triton
from megatron_async.kernels.triton_decode_attention import decode_attention
from megatron_async.kernels.triton_invariant_attention import invariant_attention, tiles
from megatron_async.kernels.triton_invariant_matmul import (
    TileConfig, invariant_linear, invariant_swiglu, launch_tiles, tile_config,
)
from megatron_async.kernels.triton_prefill_attention import prefill_attention
from megatron_async.kernels.triton_prefill_common import LONG_TILE_MIN_QUERY
from megatron_async.kernels.triton_swiglu_matmul import swiglu_linear
from tests.helpers.paged_attention_cases import QWEN3_06B_HEADS, make_case

LAYERS = 28
SHAPES = {  # name: (weight rows N, K), qwen3-0.6b; gate_up runs the fused SwiGLU
    "qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
    "lm_head": (151936, 1024),
}
SWEEP_PREFILL = [(128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (128, 64, 4, 4), (128, 64, 8, 4),
                 (64, 128, 4, 4), (64, 256, 8, 3)]
SWEEP_DECODE = [(64, 64, 4, 4), (64, 32, 4, 4), (128, 64, 8, 4), (128, 32, 4, 4), (64, 128, 4, 3)]
SWEEP_ATTENTION = [(64, 32, 4, r, s) for r in (128, 0) for s in (2, 3)] + [(64, 64, 4, r, 2) for r in (128, 0)] + [
    (128, n, 8, r, s) for n in (32, 64) for r in (128, 0) for s in (2, 3)] + [(16, 64, 4, 0, 2), (32, 64, 4, 0, 2)]
"""(matrix rows a tile, keys a tile, warps, register cap (0: the compiler's), stages)."""
TABLE_KEYS = 4096  # the engine's default max_sequence_length: the block table's width in keys
LONG_TABLE_KEYS = 16384  # the long-context steps' (prompts of 8-16k)


def _label(t: TileConfig) -> str:
    return f"{t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}"


def _gemm(name: str, x: torch.Tensor, w: torch.Tensor, tiles: TileConfig | None) -> torch.Tensor:
    return invariant_swiglu(x, w, tiles=tiles) if name == "gate_up" else invariant_linear(x, w, tiles=tiles)


def matmul(rows: list[int], sweep_rows: list[int]) -> list[str]:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print("\ninvariant matmul: us per call in a graph (TFLOP/s); bits: equal to the old launch's at every row")
    print("| GEMM | rows | cuBLAS | old launch | launch_tiles | no tiles given (TMA from 1,024 rows) | best of sweep | bits |"
          "\n|---|---:|---:|---:|---:|---:|---|---|")
    summary = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.03 for _ in range(1 if name == "lm_head" else LAYERS)]
        calls = len(ws) * (1 if name == "lm_head" else 2)
        for m in rows:
            if name == "lm_head" and m > 256:  # prefill steps take the LM head of a few rows only
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            flop = 2 * m * n * k

            def us(tiles: TileConfig | None) -> float:
                return graph_call_us([lambda w=w: _gemm(name, x, w, tiles) for w in ws], calls)

            old_t, new_t = tile_config(n, k, dev), launch_tiles(m, n, k, dev, swiglu=name == "gate_up")
            base = _gemm(name, x, ws[0], old_t)
            sweep = m in sweep_rows
            cands = [new_t] + ([dataclasses.replace(old_t, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
                                for bm, bn, nw, ns in (SWEEP_PREFILL if m >= 1024 else SWEEP_DECODE)] if sweep else [])
            same, timed = True, []
            for t in dict.fromkeys(cands):
                try:
                    same &= torch.equal(_gemm(name, x, ws[0], t), base)
                    timed.append((us(t), t))
                except Exception as e:  # noqa: BLE001 - a launch that does not compile is reported and skipped
                    print(f"  {name} {m} {_label(t)}: {type(e).__name__}: {str(e)[:120]}")
            for s, t in sorted(timed, key=lambda r: r[0])[:4] if sweep else []:
                print(f"  {name} rows {m}: {s:.1f} us {_label(t)}")
            old_us, new_us, auto_us = us(old_t), us(new_t), us(None)
            same &= torch.equal(_gemm(name, x, ws[0], None), base)
            cublas = graph_call_us([lambda w=w: F.linear(x, w) for w in ws], calls)
            best = min(timed, key=lambda r: r[0]) if sweep and timed else None
            cell = lambda v: f"{v:.1f} ({flop / v / 1e6:,.0f})"  # noqa: E731
            print(f"| {name} | {m} | {cell(cublas)} | {cell(old_us)} | {cell(new_us)} [{_label(new_t)}] | {cell(auto_us)} | "
                  f"{'' if best is None else cell(best[0]) + ' [' + _label(best[1]) + ']'} | {same} |", flush=True)
            summary.append(f"{name:8s} {m:5d}: old {old_us:8.1f} new {new_us:8.1f} no tiles {auto_us:8.1f} us"
                           f"{'' if best is None else f' best {best[0]:.1f} {_label(best[1])}'} bits {same}")
            if name == "gate_up":  # the default mode's TMA kernel: the same rounding steps, another launch
                fused = graph_call_us([lambda w=w: swiglu_linear(x, w) for w in ws], calls)
                fused_same = torch.equal(swiglu_linear(x, ws[0]), base)
                print(f"  gate_up rows {m}: default mode's fused kernel {fused:.1f} us, bits == invariant {fused_same}")
    return summary


def _step(rows: list[tuple[int, int]], seed: int, table_keys: int = TABLE_KEYS):
    case = make_case(rows, block_size=16, seed=seed, table_width=table_keys // 16, dtype=torch.bfloat16, device="cuda",
                     **QWEN3_06B_HEADS)
    attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)  # append the new keys
    case.meta.long_tiles = max(n for _, n in rows) >= LONG_TILE_MIN_QUERY  # as the host marks such a step
    return case


def attention(sweep: bool, long: bool = False) -> list[str]:
    gen = torch.Generator().manual_seed(11)
    steps = [("decode 128 x 100-1,152", _step([(n - 1, 1) for n in longest_first_lens(128, 100, 1152)], 3))]
    for tokens in (2048, 8192):
        rows = prompt_rows(tokens - 64, 100, 1024, gen)
        rows += [(int(torch.randint(100, 1025, (1,), generator=gen)), 1) for _ in range(64)]
        steps.append((f"mixed {tokens} tokens", _step(rows, 5)))
    if long:  # chunks of 8-16k prompts after 4-12k of their keys, as chunked prefill runs them
        steps.append(("long prefill 8,192 tokens", _step([(4096, 2048), (8192, 2048), (6144, 2048), (12288, 2048)], 7,
                                                         LONG_TABLE_KEYS)))
        steps.append(("long decode 32 x 8-16k", _step([(n - 1, 1) for n in longest_first_lens(32, 8192, 16384)], 9,
                                                      LONG_TABLE_KEYS)))
    print("\ninvariant attention: us per call in a graph; bits: equal to the uncapped launch's")
    print("| step | default mode's kernel | uncapped | default launch | best of sweep | bits |\n|---|---:|---:|---:|---|---|")
    summary = []
    for label, case in steps:
        q, cache, meta, scale = case.q, case.kv_cache, case.meta, case.scale
        us = lambda fn: graph_call_us([fn], LAYERS)  # noqa: E731
        old = functools.partial(invariant_attention, q, cache, meta, scale, maxnreg=0, num_stages=2)
        new = functools.partial(invariant_attention, q, cache, meta, scale)
        ref = functools.partial(decode_attention if meta.is_decode_only else prefill_attention, q, cache, meta, scale)
        base = old()
        same = torch.equal(new(), base)
        table_n = tiles(q.shape[1] // cache.shape[3], q.device, meta.block_table.shape[1] * cache.shape[2])[1]
        timed, bases = [], {table_n: base}
        for rows, block_n, warps, maxnreg, stages in SWEEP_ATTENTION if sweep else []:
            fn = functools.partial(invariant_attention, q, cache, meta, scale, block_n=block_n, maxnreg=maxnreg,
                                   num_stages=stages, tile_rows=rows, num_warps=warps)
            out = fn()
            ref_bits = bases.setdefault(block_n, out)  # a key tile is a summation order: bits against its own
            timed.append((us(fn), f"{rows}x{block_n} w{warps} r{maxnreg or '-'} s{stages}", torch.equal(out, ref_bits)))
            print(f"  {label}: {timed[-1][0]:.1f} us {timed[-1][1]} bits {timed[-1][2]}", flush=True)
        best = min(timed, key=lambda r: r[0]) if timed else None
        ref_us, old_us, new_us = us(ref), us(old), us(new)
        best_cell = "" if best is None else f"{best[0]:.1f} [{best[1]}]"
        print(f"| {label} | {ref_us:.1f} | {old_us:.1f} | {new_us:.1f} | {best_cell} | {same} |", flush=True)
        summary.append(f"attn {label}: default-mode {ref_us:.1f} uncapped {old_us:.1f} default {new_us:.1f} us"
                       f"{'' if best is None else f' best {best_cell}'} bits {same}")
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", nargs="+", choices=["matmul", "attention"], default=["matmul", "attention"])
    p.add_argument("--rows", type=int, nargs="+", default=[128, 1024, 2048, 8192])
    p.add_argument("--sweep", action="store_true", help="also time the candidate launches")
    p.add_argument("--long", action="store_true", help="the attention at long context too (8-16k-token prompts)")
    p.add_argument("--sweep-rows", type=int, nargs="+", default=[128, 8192], help="matmul row counts --sweep covers")


def run(args: argparse.Namespace) -> None:
    summary = matmul(args.rows, args.sweep_rows if args.sweep else []) if "matmul" in args.part else []
    summary += attention(args.sweep, args.long) if "attention" in args.part else []
    print("\nsummary:\n" + "\n".join(summary))
