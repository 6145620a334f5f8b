"""The decode attention's split count (``choose_num_splits``) against every count the kernel could
run: rows x KV heads below two programs an SM (where the rule splits), keys equal (4,096 and 16,384
a row) and mixed (1,024-8,192), bf16, head_dim 128, 16-token pages, the block table 16k tokens
wide as an engine's is; us per call in a CUDA graph. Each row of the table: the rule's pick, the
fastest count and the times at 1-12 splits; last, the mean over the cases of the rule's time
against the fastest.

    python -m benchmarks kernel-times decode-splits [--heads 16 8 32 8] [--rows 4 8 12 16 20 24 28 32]
    python -m benchmarks kernel-times decode-splits --heads 8 2 --rows 124 --keys 100-1152   # a TP=4 rank of the 8B
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.kernel_times.paged_attention import graph_ms
from megatron_async.kernels.decode_splits import choose_num_splits
from megatron_async.kernels.triton_decode_attention import decode_attention
from tests.helpers.paged_attention_cases import make_case

KEYS = ("4096", "1024-8192", "16384")
TABLE_TOKENS = 16384
COUNTS = (*range(1, 13), 16, 24, 32)


def lengths(keys: str, rows: int, gen: torch.Generator) -> list[int]:
    if keys.isdigit():
        return [int(keys)] * rows
    lo, hi = map(int, keys.split("-"))
    return torch.randint(lo, hi + 1, (rows,), generator=gen).tolist()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 8, 32, 8],
                        help="pairs of query / KV heads (default: 16 8 and 32 8)")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 12, 16, 20, 24, 28, 32])
    parser.add_argument("--keys", nargs="+", default=list(KEYS),
                        help="keys a row: N (every row) or LO-HI (uniform at random)")
    parser.add_argument("--iters", type=int, default=20)


def run(args: argparse.Namespace) -> None:
    if len(args.heads) % 2:
        raise SystemExit("--heads takes pairs of query / KV heads")
    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(1)
    ratios = []
    print("| heads | rows | keys | rule: splits / us | fastest: splits / us | 1..12 splits, us |\n|---|---:|---|---:|---:|---|")
    for heads, kv_heads in zip(args.heads[::2], args.heads[1::2]):
        for rows in args.rows:
            for keys in args.keys:
                lens = lengths(keys, rows, gen)
                width = -(-max(TABLE_TOKENS, max(lens)) // 16)
                case = make_case([(n - 1, 1) for n in lens], num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                                 block_size=16, dtype=torch.bfloat16, device=dev, unused=0.0, table_width=width)
                rule = choose_num_splits(rows, kv_heads, width, 16, dev)
                us = {s: graph_ms(lambda s=s: decode_attention(case.q, case.kv_cache, case.meta, case.scale,
                                                               num_splits=s), args.iters) * 1e3
                      for s in sorted({*COUNTS, rule})}
                best = min(us, key=us.get)
                ratios.append(us[rule] / us[best])
                print(f"| {heads}/{kv_heads} | {rows} | {keys} | {rule} / {us[rule]:.1f} | {best} / {us[best]:.1f} | "
                      + " ".join(f"{us[s]:.0f}" for s in range(1, 13)) + " |", flush=True)
                del case
    print(f"\nthe rule's time / the fastest count's: mean {statistics.fmean(ratios):.3f}, max {max(ratios):.3f} "
          f"over {len(ratios)} cases")
