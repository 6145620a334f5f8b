"""Triton paged attention against the torch reference at Qwen3-0.6B's shape (16 query heads, 8 KV
heads, head_dim 128, bf16), KV blocks of 16 and 64 tokens: eager time of both, the Triton call's
host time, and the decode kernel's time and KV read bandwidth in a CUDA graph; decode batches of
1-256 rows with KV lengths up to 2,048, and a mixed step (prefill chunks, some continuing a cached
prefix, plus 64 decode rows). The errors and the KV-append column are for orientation: the
assertions are tests/unit_tests/kernels/test_attention_triton_gpu.py's.

    python -m benchmarks kernel-times paged-attention [--iters 20] [--block-sizes 16 64] [--batches 1 8 64 256]
    python -m benchmarks kernel-times paged-attention --sweep 128 100 1152 [--sweep-heads-first] [--heads 32 8]
    python -m benchmarks kernel-times paged-attention --sweep-prefill 8192 100 1024 | --grid-order
    python -m benchmarks kernel-times paged-attention --row-order 128 100 1152 | --decode-grid 128 100 1152
    python -m benchmarks kernel-times paged-attention --call-cost   # what a decode call costs beside its bytes

Its case builders (``decode_case``, ``longest_first_lens``) serve the other attention families
(attention-read-bound, invariant-kernels)."""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from benchmarks.cuda_timing import graph_call_us, host_us, median_ms
from benchmarks.roofline import measure_copy_bandwidth
from megatron_async.kernels import attention_torch, attention_triton
from megatron_async.kernels.decode_splits import choose_num_splits
from megatron_async.kernels.triton_decode_attention import decode_attention
from tests.helpers.paged_attention_cases import PagedCase, decode_rows, make_case, mixed_rows

HEADS, KV_HEADS, HEAD_DIM, MAX_LEN = 16, 8, 128, 2048


@dataclass
class Row:
    name: str
    max_abs: float
    max_rel: float
    kv_same: bool
    torch_ms: float
    triton_ms: float
    host_us: float
    decode_ms: float | None = None
    decode_gbps: float | None = None
    splits: int | None = None


def graph_ms(fn: Callable[[], object], iters: int) -> float:
    """Median time of ``fn`` captured in a CUDA graph: kernel time without launch overhead."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, iters)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (out.float() - ref.float()).abs().max().item()
    return diff, diff / max(ref.float().abs().max().item(), 1e-12)


def time_case(name: str, case: PagedCase, iters: int) -> Row:
    ref_out, ref_cache = case.reference()
    out = attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)
    max_abs, max_rel = errors(out, ref_out)
    kv_same = torch.equal(torch.nan_to_num(case.kv_cache, nan=0.0), ref_cache)

    def torch_step() -> torch.Tensor:
        attention_torch.write_kv(ref_cache, case.k, case.v, case.meta.slot_mapping[: case.meta.num_tokens])
        return attention_torch.paged_attention(case.q, ref_cache, case.meta, case.scale)

    def triton_step() -> torch.Tensor:
        return attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)

    row = Row(name, max_abs, max_rel, kv_same, torch_ms=median_ms(torch_step, iters),
              triton_ms=median_ms(triton_step, iters), host_us=host_us(triton_step, iters))
    if case.meta.is_decode_only:
        row.decode_ms = graph_ms(lambda: decode_attention(case.q, case.kv_cache, case.meta, case.scale), iters)
        kv_tokens = int(case.meta.kv_lens.sum())
        kv_bytes = 2 * kv_tokens * KV_HEADS * HEAD_DIM * case.kv_cache.element_size()
        row.decode_gbps = kv_bytes / (row.decode_ms * 1e-3) / 1e9
        row.splits = choose_num_splits(case.meta.num_rows, KV_HEADS, case.meta.block_table.shape[1],
                                       case.meta.block_size, case.q.device)
    return row


def run_cases(block_sizes: list[int], batches: list[int], iters: int) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    shape = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    rows = []
    for bs in block_sizes:
        for batch in batches:
            case = make_case(decode_rows(batch, MAX_LEN, gen), block_size=bs, seed=batch, **shape)
            rows.append(time_case(f"decode bs={bs} rows={batch}", case, iters))
            del case
        case = make_case(mixed_rows(MAX_LEN, gen), block_size=bs, seed=1, **shape)
        rows.append(time_case(f"mixed bs={bs} T={case.meta.num_tokens}", case, iters))
        del case
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[Row]) -> None:
    def fmt(x: float | int | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    print("eager ms: attend incl. KV append (torch reference vs Triton), median of CUDA-event timings;")
    print("host us: CPU cost of one eager Triton call; graph ms / KV GB/s: decode kernels alone, CUDA-graph replay;")
    print("KV ==: the cache after the Triton append equals the reference's")
    print(f"{'case':<24} {'max_abs':>9} {'max_rel':>9} {'KV ==':>6} {'torch ms':>9} {'triton ms':>9} {'speedup':>8}"
          f" {'host us':>8} {'graph ms':>9} {'KV GB/s':>8} {'splits':>6}")
    for r in rows:
        print(f"{r.name:<24} {r.max_abs:>9.2e} {r.max_rel:>9.2e} {str(r.kv_same):>6} {r.torch_ms:>9.3f} {r.triton_ms:>9.3f}"
              f" {r.torch_ms / r.triton_ms:>7.1f}x {r.host_us:>8.0f} {fmt(r.decode_ms, '9.3f'):>9}"
              f" {fmt(r.decode_gbps, '8.0f'):>8} {fmt(r.splits, 'd'):>6}")


def decode_case(lens: list[int], block_size: int = 16) -> tuple[PagedCase, int]:
    """A decode step of one new token per row (KV lengths ``lens``, KV blocks of ``block_size``
    tokens: the engine's default 16) with its keys appended, and the K/V bytes it reads."""
    case = make_case([(n - 1, 1) for n in lens], block_size=block_size, seed=3, num_heads=HEADS, num_kv_heads=KV_HEADS,
                     head_dim=HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)  # append the new keys
    return case, 2 * int(case.meta.kv_lens.sum()) * KV_HEADS * HEAD_DIM * case.kv_cache.element_size()


def longest_first_lens(batch: int, min_len: int, max_len: int) -> list[int]:
    gen = torch.Generator().manual_seed(7)
    return sorted(torch.randint(min_len, max_len + 1, (batch,), generator=gen).tolist(), reverse=True)


def sweep(iters: int, batch: int, min_len: int, max_len: int, heads_fastest: bool) -> None:
    """Decode kernel launch settings at one batch (KV lengths uniform in [min_len, max_len],
    rows longest first as the engine launches them, KV blocks of 16 tokens as the engine's
    default; ``heads_fastest``: the grid's KV-head order): graph ms and KV GB/s per variant,
    and whether its output equals the default's bits."""
    case, kv_bytes = decode_case(longest_first_lens(batch, min_len, max_len))
    base = decode_attention(case.q, case.kv_cache, case.meta, case.scale)
    order = "KV heads" if heads_fastest else "rows"
    print(f"\ndecode sweep ({order} first): {batch} rows, KV {min_len}-{max_len} tokens, {kv_bytes / 1e6:.0f} MB of KV")
    print("| splits | block_n | warps | stages | graph us | KV GB/s | bits == default |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for splits in (1, 2):
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    kw = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages,
                              heads_fastest=heads_fastest)
                    try:
                        out = decode_attention(case.q, case.kv_cache, case.meta, case.scale, **kw)
                        ms = graph_ms(lambda: decode_attention(case.q, case.kv_cache, case.meta, case.scale, **kw),
                                      iters)
                    except Exception as e:  # out of shared memory / registers for this variant
                        print(f"| {splits} | {block_n} | {warps} | {stages} | failed: {type(e).__name__} | | |")
                        continue
                    print(f"| {splits} | {block_n} | {warps} | {stages} | {ms * 1e3:.1f} | "
                          f"{kv_bytes / (ms * 1e-3) / 1e9:.0f} | {torch.equal(out, base)} |")


def row_order(iters: int, batch: int, min_len: int, max_len: int) -> None:
    """The default decode launch on one ragged batch with its rows in three orders: the grid
    walks rows fastest, so the order decides which rows' programs start last (the tail)."""
    gen = torch.Generator().manual_seed(7)
    lens = torch.randint(min_len, max_len + 1, (batch,), generator=gen).tolist()
    print(f"\ndecode row order: {batch} rows, KV {min_len}-{max_len} tokens")
    print("| order | graph us | KV GB/s |\n|---|---:|---:|")
    for order, ordered in (("random", lens), ("longest first", sorted(lens, reverse=True)),
                           ("shortest first", sorted(lens))):
        case, kv_bytes = decode_case(ordered)
        ms = graph_ms(functools.partial(decode_attention, case.q, case.kv_cache, case.meta, case.scale), iters)
        print(f"| {order} | {ms * 1e3:.1f} | {kv_bytes / (ms * 1e-3) / 1e9:.0f} |")


def decode_grid(iters: int, batch: int, min_len: int, max_len: int) -> None:
    """The decode kernel with rows or KV heads fastest in its grid (rows longest first, as the
    engine launches them), at a few tile / stage settings: us per call in a graph, KV GB/s,
    same bits as the default; then the default launch's registers and shared memory."""
    case, kv_bytes = decode_case(longest_first_lens(batch, min_len, max_len))
    base = decode_attention(case.q, case.kv_cache, case.meta, case.scale)
    print(f"\ndecode grid order: {batch} rows longest first, KV {min_len}-{max_len} tokens, {kv_bytes / 1e6:.0f} MB")
    print("| grid | block_n | stages | graph us | KV GB/s | bits == default |\n|---|---:|---:|---:|---:|---|")
    for block_n, stages in ((128, 4), (128, 3), (64, 4), (64, 2)):
        for heads_fastest in (False, True, False, True):
            kw = dict(block_n=block_n, num_stages=stages, heads_fastest=heads_fastest)
            fn = functools.partial(decode_attention, case.q, case.kv_cache, case.meta, case.scale, **kw)
            ms = graph_ms(fn, iters)
            print(f"| {'KV heads' if heads_fastest else 'rows'} first | {block_n} | {stages} | {ms * 1e3:.1f} | "
                  f"{kv_bytes / (ms * 1e-3) / 1e9:.0f} | {torch.equal(fn(), base)} |")
    from megatron_async.kernels.triton_decode_attention import _decode_split_kernel
    try:  # Triton's per-device cache of compiled variants (an internal layout: best effort)
        for kernel in _decode_split_kernel.device_caches[torch.cuda.current_device()][0].values():
            print(f"compiled variant: regs {kernel.n_regs}, shared {kernel.metadata.shared} B, "
                  f"warps {kernel.metadata.num_warps}, stages {kernel.metadata.num_stages}")
    except Exception as e:  # noqa: BLE001
        print(f"compiled variants not readable: {type(e).__name__}: {e}")


def call_cost(iters: int) -> None:
    """The default decode launch (one split), 10 calls in one CUDA graph as a step's layers make
    them: rows of one key (the programs' start and end alone), the same programs in fewer or more
    waves (128 and 512 rows of 600 keys), one wave of long programs and workload A's ragged rows: us
    per call, KV GB/s, us beside the KV bytes' time at the copy rate, and the cost per call that a
    straight line through the two row counts puts beside the bytes."""
    gbps = measure_copy_bandwidth(torch.device("cuda")) / 1e9
    cases = [("128 rows x 1 key", [1] * 128), ("128 rows x 600 keys", [600] * 128),
             ("512 rows x 600 keys", [600] * 512), ("33 rows x 4,096 keys (one wave)", [4096] * 33),
             ("workload A: 128 rows x 100-1,152 keys", longest_first_lens(128, 100, 1152))]
    print(f"\ndecode call cost (copy {gbps:,.0f} GB/s; 10 calls a graph)")
    print("| case | us | KV GB/s | beside bytes us |\n|---|---:|---:|---:|")
    timed = []
    for name, lens in cases:
        case, kv_bytes = decode_case(lens)
        call = functools.partial(decode_attention, case.q, case.kv_cache, case.meta, case.scale, num_splits=1)
        us = graph_call_us([call], calls_per_graph=10, replays=iters)
        timed.append((us, kv_bytes))
        print(f"| {name} | {us:.1f} | {kv_bytes / us / 1e3:.0f} | {us - kv_bytes / gbps / 1e3:.1f} |")
        del case
    (u1, b1), (u4, b4) = timed[1], timed[2]
    rate = (b4 - b1) / (u4 - u1) / 1e3
    print(f"a line through 128 and 512 rows: {rate:,.0f} GB/s plus {u1 - b1 / rate / 1e3:.1f} us a call")


def prompt_rows(tokens: int, min_len: int, max_len: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """(cached prefix, new tokens) rows of prompts of [min_len, max_len] tokens packed into
    ``tokens`` (the last chunk cut, every third prompt continuing a cached first half)."""
    rows, left = [], tokens
    while left > 0:
        n = min(int(torch.randint(min_len, max_len + 1, (1,), generator=gen)), left)
        prefix = n // 2 if len(rows) % 3 == 2 else 0
        rows.append((prefix, n - prefix))
        left -= n - prefix
    return rows


def attention_flops(rows: list[tuple[int, int]], heads: int | None = None, head_dim: int = HEAD_DIM) -> int:
    """Causal work: each query attends to prefix + its index + 1 keys (4 * D FLOPs per key per head;
    ``heads`` query heads, default ``HEADS``)."""
    return sum(4 * (heads or HEADS) * head_dim * (p * q + q * (q + 1) // 2) for p, q in rows)


# (block_q, block_n, warps, stages, register cap; 0: the compiler's choice) of the prefill sweep
PREFILL_VARIANTS = [(32, 32, 4, 3, 128), (32, 32, 4, 2, 0), (32, 16, 4, 2, 128), (32, 16, 4, 3, 128),
                    (32, 64, 4, 2, 0), (32, 64, 4, 3, 168), (64, 32, 8, 2, 128), (64, 32, 8, 3, 0),
                    (64, 64, 8, 3, 0), (64, 64, 8, 3, 168), (64, 128, 8, 3, 0)]


def prefill_case(tokens: int, min_len: int, max_len: int, decode_rows: int) -> tuple[PagedCase, int]:
    """A mixed step like workload A's (``prompt_rows`` into ``tokens`` less the decode rows, then
    ``decode_rows`` rows of one new token), its keys appended, and its attention FLOPs."""
    gen = torch.Generator().manual_seed(11)
    rows = prompt_rows(tokens - decode_rows, min_len, max_len, gen)
    rows += [(int(torch.randint(min_len, max_len + 1, (1,), generator=gen)), 1) for _ in range(decode_rows)]
    case = make_case(rows, block_size=16, seed=5, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                     dtype=torch.bfloat16, device="cuda")
    attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)  # append the new keys
    return case, attention_flops(rows)


def sweep_prefill(iters: int, tokens: int, min_len: int, max_len: int) -> None:
    """Prefill kernel launch settings (``PREFILL_VARIANTS``) on two mixed steps like workload A's:
    prompts of [min_len, max_len] tokens packed into ``tokens`` (the last chunk cut, every third
    prompt continuing a cached first half), without and with 64 decode rows; graph us and
    attention TFLOP/s, and the largest difference from the default launch's output."""
    from megatron_async.kernels.triton_prefill_attention import prefill_attention

    cases = [prefill_case(tokens, min_len, max_len, decode) for decode in (0, 64)]
    bases = [prefill_attention(c.q, c.kv_cache, c.meta, c.scale) for c, _ in cases]
    print(f"\nprefill sweep: {tokens} tokens, prompts {min_len}-{max_len}, without / with 64 decode rows "
          f"({cases[0][1] / 1e9:.1f} / {cases[1][1] / 1e9:.1f} GFLOP)")
    print("| block_q | block_n | warps | stages | max regs | us | TFLOP/s | us, decode rows | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for block_q, block_n, warps, stages, maxnreg in [(None,) * 5] + PREFILL_VARIANTS:
        kw = dict(block_q=block_q, block_n=block_n, maxnreg=maxnreg,
                  **({"num_warps": warps, "num_stages": stages} if warps else {}))
        cells = f"| {block_q or 'default'} | {block_n or ''} | {warps or ''} | {stages or ''} | {maxnreg or '-'} |"
        times, diff = [], 0.0
        try:
            for (case, _), base in zip(cases, bases):
                fn = functools.partial(prefill_attention, case.q, case.kv_cache, case.meta, case.scale, **kw)
                diff = max(diff, (fn().float() - base.float()).abs().max().item())
                times.append(graph_ms(fn, iters))
        except Exception as e:  # out of shared memory / registers for this variant
            print(f"{cells} failed: {type(e).__name__} | | | |")
            continue
        print(f"{cells} {times[0] * 1e3:.1f} | {cases[0][1] / (times[0] * 1e-3) / 1e12:.0f} | "
              f"{times[1] * 1e3:.1f} | {diff:.2e} |")


def grid_order(iters: int) -> None:
    """The prefill kernel with query tiles fastest in its grid against KV heads fastest (the
    default), on the sweep's mixed step without its decode rows (8,192 tokens, prompts
    100-1,024, KV blocks of 16 tokens as the engine's default), then with KV blocks of 64
    and 256 tokens (what the paged gather costs): us per call in a graph, same bits."""
    from megatron_async.kernels.triton_prefill_attention import prefill_attention

    rows = prompt_rows(8192, 100, 1024, torch.Generator().manual_seed(11))
    flops = attention_flops(rows)
    print(f"\nprefill grid order: {sum(q for _, q in rows)} tokens in {len(rows)} rows, {flops / 1e9:.1f} GFLOP")
    print("| KV block | grid | graph us | TFLOP/s | bits == tiles first |\n|---:|---|---:|---:|---|")
    for block_size in (16, 64, 256):
        case = make_case(rows, block_size=block_size, seed=5, num_heads=HEADS, num_kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)
        base = prefill_attention(case.q, case.kv_cache, case.meta, case.scale, heads_fastest=False)
        for heads_fastest in (False, True) * (2 if block_size == 16 else 1):
            fn = functools.partial(prefill_attention, case.q, case.kv_cache, case.meta, case.scale,
                                   heads_fastest=heads_fastest)
            ms = graph_ms(fn, iters)
            print(f"| {block_size} | {'KV heads' if heads_fastest else 'tiles'} first | {ms * 1e3:.1f} | "
                  f"{flops / (ms * 1e-3) / 1e12:.0f} | {torch.equal(fn(), base)} |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", type=int, nargs=3, metavar=("BATCH", "MIN_LEN", "MAX_LEN"), default=None,
                        help="only sweep the decode kernel's launch settings at this batch and KV length range")
    parser.add_argument("--sweep-heads-first", action="store_true", help="--sweep with KV heads first in the grid")
    parser.add_argument("--row-order", type=int, nargs=3, metavar=("BATCH", "MIN_LEN", "MAX_LEN"), default=None,
                        help="only time the default decode launch with the rows random / longest / shortest first")
    parser.add_argument("--sweep-prefill", type=int, nargs=3, metavar=("TOKENS", "MIN_LEN", "MAX_LEN"), default=None,
                        help="only sweep the prefill kernel's launch settings on one mixed step")
    parser.add_argument("--grid-order", action="store_true",
                        help="only time the prefill kernel with query tiles or KV heads first in its grid")
    parser.add_argument("--decode-grid", type=int, nargs=3, metavar=("BATCH", "MIN_LEN", "MAX_LEN"), default=None,
                        help="only time the decode kernel with rows or KV heads first in its grid")
    parser.add_argument("--call-cost", action="store_true",
                        help="only the decode launch's cost per call beside its bytes, at four row sets")
    parser.add_argument("--heads", type=int, nargs=2, metavar=("HEADS", "KV_HEADS"), default=None,
                        help="query and KV heads per rank for --sweep / --row-order (default 16 8, Qwen3-0.6B)")


def run(args: argparse.Namespace) -> None:
    if args.heads:
        global HEADS, KV_HEADS
        HEADS, KV_HEADS = args.heads
    if args.sweep:
        sweep(args.iters, *args.sweep, args.sweep_heads_first)
    if args.sweep_prefill:
        sweep_prefill(args.iters, *args.sweep_prefill)
    if args.row_order:
        row_order(args.iters, *args.row_order)
    if args.grid_order:
        grid_order(args.iters)
    if args.decode_grid:
        decode_grid(args.iters, *args.decode_grid)
    if args.call_cost:
        call_cost(args.iters)
    if any((args.sweep, args.sweep_prefill, args.row_order, args.grid_order, args.decode_grid, args.call_cost)):
        return
    print_table(run_cases(args.block_sizes, args.batches, args.iters))
