"""The decode step's small kernels at Qwen3-0.6B shapes (bf16, CUDA): residual add + RMSNorm, q/k
norm + rotary + K/V store, and the greedy argmax over the vocabulary; us per call in a CUDA graph
(28 distinct inputs cycled, as the layers of a step), launch settings swept; a cell marked "!"
gave other bits than the default launch (torch's argmax for the argmax): the assertions are
tests/unit_tests/kernels/test_fused_ops_gpu.py's and test_triton_sampling_gpu.py's.

    python -m benchmarks kernel-times small-kernels [--tokens 1 64 128 256] [--warps 1 2 4 8]
    python -m benchmarks kernel-times small-kernels --rope-before OLD/triton_rope.py   # an A/B in one process
    python -m benchmarks kernel-times small-kernels --argmax-sweep 128"""
from __future__ import annotations

import argparse
import importlib.util

import torch

from benchmarks.cuda_timing import graph_call_us
from megatron_async.kernels import triton_rmsnorm, triton_rope, triton_sampling

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, BLOCK_SIZE = 1024, 16, 8, 128, 151936, 16
DT = torch.bfloat16
LAYERS = 28


def _load(path: str):
    spec = importlib.util.spec_from_file_location("rope_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def norm_rows(tokens: list[int], warps: list[int]) -> None:
    print("\n| add + RMSNorm [T, 1024] | " + " | ".join(f"{w} warps" for w in warps) + " |")
    print("|---:|" + "---:|" * len(warps))
    default = triton_rmsnorm.num_warps
    for t in tokens:
        sets = [(torch.randn(t, HIDDEN, device="cuda", dtype=DT), torch.randn(t, HIDDEN, device="cuda", dtype=DT),
                 torch.rand(HIDDEN, device="cuda", dtype=DT)) for _ in range(LAYERS)]
        ref = triton_rmsnorm.add_rms_norm(*sets[0], 1e-6)
        cells = []
        for w in warps:
            triton_rmsnorm.num_warps = lambda block, w=w: w
            got = triton_rmsnorm.add_rms_norm(*sets[0], 1e-6)
            same = all(torch.equal(a, b) for a, b in zip(ref, got))
            fns = [lambda s=s: triton_rmsnorm.add_rms_norm(*s, 1e-6) for s in sets]
            cells.append(f"{graph_call_us(fns, 2 * LAYERS):.2f}{'' if same else ' !'}")
        triton_rmsnorm.num_warps = default
        print(f"| {t} | " + " | ".join(cells) + f" |  (default {default(triton_rmsnorm.triton.next_power_of_2(HIDDEN))})")


def rope_rows(tokens: list[int], warps: list[int], before) -> None:
    """The current kernel at each warp count; ``before`` (another triton_rope.py) at its own launch."""
    cols = [f"{w} warps" for w in warps] + (["before, its own launch"] if before else [])
    print("\n| q/k norm + rope + K/V store | " + " | ".join(cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    default = triton_rope.num_warps
    for t in tokens:
        blocks = max(64, 4 * t)
        cache = torch.zeros(2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT)

        def inputs():
            qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DT)
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            ang = torch.rand(t, HEAD_DIM // 2, device="cuda") * 6.28
            slots = torch.randperm(blocks * BLOCK_SIZE, device="cuda")[:t]
            return (q.view(t, HEADS, HEAD_DIM), k.view(t, KV_HEADS, HEAD_DIM), ang.cos().to(DT), ang.sin().to(DT),
                    torch.rand(HEAD_DIM, device="cuda", dtype=DT), torch.rand(HEAD_DIM, device="cuda", dtype=DT),
                    1e-6, v.view(t, KV_HEADS, HEAD_DIM), cache, slots)

        sets = [inputs() for _ in range(LAYERS)]
        ref = triton_rope.rope_qk(*sets[0])[0], cache.clone()
        cells = []
        for w in warps:
            triton_rope.num_warps = lambda h, b, w=w: w
            cache.zero_()
            got = triton_rope.rope_qk(*sets[0])[0]
            same = torch.equal(got, ref[0]) and torch.equal(cache, ref[1])
            us = graph_call_us([lambda s=s: triton_rope.rope_qk(*s) for s in sets], LAYERS)
            cells.append(f"{us:.2f}{'' if same else ' !'}")
        triton_rope.num_warps = default
        if before:
            cache.zero_()
            got = before.rope_qk(*sets[0])[0]
            same = torch.equal(got, ref[0]) and torch.equal(cache, ref[1])
            us = graph_call_us([lambda s=s: before.rope_qk(*s) for s in sets], LAYERS)
            cells.append(f"{us:.2f}{'' if same else ' !'}")
        print(f"| {t} | " + " | ".join(cells) + " |")


def argmax_rows(tokens: list[int]) -> None:
    print("\n| greedy argmax [T, 151936] bf16 | torch.argmax | Triton chunks |\n|---:|---:|---:|")
    for t in tokens:
        sets = [torch.randn(t, VOCAB, device="cuda", dtype=DT) for _ in range(4)]
        x = sets[0]
        x[:, 5] = x[:, 7] = x.max() + 1  # a tie: the first index wins
        same = all(torch.equal(triton_sampling.argmax(s), s.argmax(-1)) for s in sets)
        a = graph_call_us([lambda s=s: s.argmax(-1) for s in sets], 8)
        b = graph_call_us([lambda s=s: triton_sampling.argmax(s) for s in sets], 8)
        print(f"| {t} | {a:.2f} | {b:.2f}{'' if same else ' !'} |")


def argmax_sweep(rows: int) -> None:
    print(f"\n| argmax launch [{rows}, 151936] bf16: chunk / block / warps | us |\n|---|---:|")
    sets = [torch.randn(rows, VOCAB, device="cuda", dtype=DT) for _ in range(4)]
    for chunk in (4096, 8192, 16384):
        for block in (1024, 2048, 4096):
            for warps in (4, 8):
                if block > chunk:
                    continue
                kw = dict(chunk=chunk, block=block, num_warps=warps)
                same = torch.equal(triton_sampling.argmax(sets[0], **kw), sets[0].argmax(-1))
                us = graph_call_us([lambda s=s: triton_sampling.argmax(s, **kw) for s in sets], 8)
                print(f"| {chunk} / {block} / {warps} | {us:.2f}{'' if same else ' !'} |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 128, 256])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rope-before", default=None, help="another triton_rope.py to time beside the current one")
    parser.add_argument("--argmax-sweep", type=int, default=0, metavar="ROWS",
                        help="also sweep the argmax launch at ROWS rows")


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    norm_rows(args.tokens, args.warps)
    rope_rows(args.tokens, args.warps, _load(args.rope_before) if args.rope_before else None)
    argmax_rows(args.tokens)
    if args.argmax_sweep:
        argmax_sweep(args.argmax_sweep)
