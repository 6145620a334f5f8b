"""The batched LoRA op (``kernels/triton_lora.py``: split-K shrink + expand) against its single-pass
form (``lora_single_pass``: one shrink program per slot walking all of K) at Qwen3-8B shapes, bf16,
8 adapters of rank 16: us per call in a CUDA graph cycling through 8 layers' adapter weights, for
rows spread round-robin over the slots and for rows of no adapter. Columns: the single-pass kernels,
the split-K kernels with the default mode's tiles and with batch-invariant mode's (the same below
``PREFILL_ROWS`` rows), and the split-K kernels over rows grouped by slot (``triton_lora_grouped``:
the grouping built once per step outside the timed calls; its own cost is the "grouping" line).
The last line sums one decode step's 4 targets x 36 layers at each row count, plus one grouping. The error lines first are for orientation: the assertions are the tests' (test_lora_ops*.py).

    python -m benchmarks kernel-times lora [--rows 1 8 64 128 512 4096]
    python -m benchmarks kernel-times lora --sweep --rows 1 128 4096 --targets qkv down"""
from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.cuda_timing import graph_call_us
from benchmarks.lora_single_pass import lora_add_single_pass
from megatron_async.kernels.lora_groups import group_lora_rows
from megatron_async.kernels.lora_ops import lora_add_reference
from megatron_async.kernels.triton_lora import LoRATiles, lora_add_triton, lora_tiles
from megatron_async.kernels.triton_lora_grouped import grouped_tiles, lora_add_grouped

ADAPTERS, RANK, LAYER_COPIES, CALLS, MODEL_LAYERS = 8, 16, 8, 32, 36
# Qwen3-8B's adapted linears: (name, K, output slice widths)
TARGETS = (("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)), ("gate_up", 4096, (12288, 12288)),
           ("down", 12288, (4096,)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 128, 512, 4096])
    p.add_argument("--sweep", action="store_true", help="also time a grid of split-K tiles per row count")
    p.add_argument("--targets", nargs="+", choices=[name for name, _, _ in TARGETS], default=None)


def _weights(k: int, widths: tuple[int, ...], dev: torch.device):
    """LAYER_COPIES sets of (A, B, scale) and the slices' starts."""
    n, s = sum(widths), len(widths)
    bounds = [0, *itertools.accumulate(widths)]
    starts = torch.tensor(bounds, dtype=torch.int32, device=dev)
    slices = tuple(zip(bounds[:-1], bounds[1:]))
    sets = [(torch.randn(ADAPTERS, s * RANK, k, device=dev, dtype=torch.bfloat16) * 0.02,
             torch.randn(ADAPTERS, n, RANK, device=dev, dtype=torch.bfloat16) * 0.02,
             torch.rand(ADAPTERS, s, device=dev) + 0.5) for _ in range(LAYER_COPIES)]
    return sets, starts, slices


def _time(fn, x, y, sets, slots, starts) -> float:
    return graph_call_us([lambda a=a, b=b, sc=sc: fn(y, x, a, b, sc, slots, starts) for a, b, sc in sets], CALLS)


def _errors(dev: torch.device) -> None:
    for name, k, widths in TARGETS:
        sets, starts, slices = _weights(k, widths, dev)
        a, b, sc = sets[0]
        x = torch.randn(300, k, device=dev, dtype=torch.bfloat16)
        slots = (torch.arange(300, device=dev, dtype=torch.int32) % (ADAPTERS + 1)) - 1
        y0 = torch.randn(300, sum(widths), device=dev, dtype=torch.bfloat16)
        ref, old, new = y0.clone(), y0.clone(), y0.clone()
        lora_add_reference(ref, x.float(), a.float(), b.float(), sc, slots, slices)
        lora_add_single_pass(old, x, a, b, sc, slots, starts)
        lora_add_triton(new, x, a, b, sc, slots, starts)
        grp = y0.clone()
        lora_add_grouped(grp, x, a, b, sc, group_lora_rows(slots, ADAPTERS, False), starts)
        d_old, d_new, d_grp = ((t.float() - ref.float()).abs().max().item() for t in (old, new, grp))
        print(f"{name}: max |kernel - float32 reference| single-pass {d_old:.3e} split-K {d_new:.3e} grouped "
              f"{d_grp:.3e}; base rows untouched: {torch.equal(new[slots < 0], y0[slots < 0])} "
              f"{torch.equal(grp[slots < 0], y0[slots < 0])}")


def _tiles(t: LoRATiles) -> str:
    return f"{t.block_m}/{t.k_chunk}/{t.block_k}/{t.block_n}/{t.slot_programs}"


def _sweep(name: str, t: int, x, y, sets, slots, starts) -> None:
    timed = []
    chunks = ((128, 128), (256, 64), (256, 256), (512, 128), (512, 256), (1024, 128))
    for bm, (chunk, bk), bn, q in itertools.product((16, 64), chunks, (128, 256), (2, 8)):
        tiles = LoRATiles(bm, chunk, bk, bn, q)
        timed.append((_time(lambda *a, tiles=tiles: lora_add_triton(*a, tiles=tiles), x, y, sets, slots, starts),
                      tiles))
    timed.sort(key=lambda r: r[0])
    print(f"  sweep {name} T={t}: " + "; ".join(f"{us:.1f} us {_tiles(tl)}" for us, tl in timed[:3]), flush=True)


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    _errors(dev)
    print(f"\n{ADAPTERS} adapters of rank {RANK}, bf16; us per call in a graph; "
          "tiles block_m/k_chunk/block_k/block_n/slot_programs")
    print("| target | rows | adapters | single-pass | split-K | split-K batch-invariant | grouped | split / grouped "
          "| tiles | grouped tiles |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---|")
    step = {}  # rows -> [single-pass, split-K, grouped] us of one decode step's LoRA ops (round-robin rows)
    invariant = lambda *a: lora_add_triton(*a, batch_invariant=True)  # noqa: E731
    for name, k, widths in TARGETS:
        if args.targets and name not in args.targets:
            continue
        sets, starts, _ = _weights(k, widths, dev)
        for t in args.rows:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            y = torch.zeros(t, sum(widths), device=dev, dtype=torch.bfloat16)
            round_robin = torch.arange(t, device=dev, dtype=torch.int32) % ADAPTERS
            for label, slots in (("round-robin", round_robin), ("none", torch.full_like(round_robin, -1))):
                old = _time(lora_add_single_pass, x, y, sets, slots, starts)
                new = _time(lora_add_triton, x, y, sets, slots, starts)
                inv = _time(invariant, x, y, sets, slots, starts)
                groups = group_lora_rows(slots, ADAPTERS, False)
                grp = _time(lambda y, x, a, b, sc, _s, st: lora_add_grouped(y, x, a, b, sc, groups, st),
                            x, y, sets, slots, starts)
                print(f"| {name} | {t} | {label} | {old:.1f} | {new:.1f} | {inv:.1f} | {grp:.1f} | {new / grp:.2f}x | "
                      f"{_tiles(lora_tiles(t, False))} | {_tiles(grouped_tiles(t, False))} |", flush=True)
                if label == "round-robin":
                    acc = step.setdefault(t, [0.0, 0.0, 0.0])
                    acc[0] += old * MODEL_LAYERS
                    acc[1] += new * MODEL_LAYERS
                    acc[2] += grp * MODEL_LAYERS
            if args.sweep:
                _sweep(name, t, x, y, sets, round_robin, starts)
    grouping = {}
    for t in args.rows:
        slots = torch.arange(t, device=dev, dtype=torch.int32) % ADAPTERS
        grouping[t] = graph_call_us([lambda s=slots: group_lora_rows(s, ADAPTERS, False)], CALLS)
    print("\ngrouping (once per step, in a graph), us: " + "; ".join(f"T={t} {us:.1f}" for t, us in grouping.items()))
    timed = args.targets or [name for name, _, _ in TARGETS]
    print(f"LoRA ops of one step ({'/'.join(timed)} x {MODEL_LAYERS} layers, round-robin rows), ms, single-pass -> "
          "split-K -> grouped (+ grouping): " + "; ".join(
              f"T={t} {old / 1e3:.2f} -> {new / 1e3:.2f} -> {(grp + grouping[t]) / 1e3:.2f}"
              for t, (old, new, grp) in step.items()))
