"""Prefill attention TFLOP/s (causal FLOPs, ``attention_flops``) of the prefill kernels' launches
(``PrefillLaunch``: rows x keys a tile, warps, stages, register cap, kernel variant) on five steps:
one 8,192-token prompt, 4 x 2,048, 8 x 1,024 beside 64 decode rows, one 8,192-token chunk
continuing a 4,096-token cached prefix, and workload A's mixed step; bf16, head_dim 128
(``--head-dims``: others), 16 / 8 (Qwen3-0.6B) and 32 / 8 (8B) query / KV heads, pages of 16
tokens (the engine's default) and of 64 and 128 (where TMA tiles fit inside a page). Each launch:
CUDA-graph replay time after a warm-up, the largest error against a float32 torch reference, and
the launch the device actually ran where ``launch_limits`` shrank it;
one that fails to compile or launch is marked, not fatal. The short table last: per heads and page
size the default launch first, then the fastest by mean TFLOP/s, then the peers: torch's scaled
dot-product attention (its cuDNN and flash backends, GQA) on the steps whose rows are all fresh
prompts of one length (8k, 4 x 2k), over contiguous K / V (a paged cache has none: the peers
read what the step's new keys were before the append), at 16-token pages only.

    python -m benchmarks kernel-times prefill-attention [--iters 10] [--heads 16 8 32 8] [--block-sizes 16 64 128]
    python -m benchmarks kernel-times prefill-attention --kernels pointer wide   # a subset of the variants
    python -m benchmarks kernel-times prefill-attention --head-dims 64 256 --heads 16 8 --block-sizes 16

With ``flashinfer`` importable on an H100 / H200, also the engine's long-tile step on FlashInfer's
FA3 kernel (``flashinfer_prefill``: rows of 128+ tokens on FA3, one-token rows on the decode kernel,
the rest on the long-tile launch: ``HOPPER_LONG`` up to head_dim 128, the default above).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.kernel_times.paged_attention import attention_flops, graph_ms, prompt_rows
from megatron_async.kernels import attention_triton, flashinfer_prefill, launch_limits
from megatron_async.kernels.triton_prefill_attention import prefill_attention
from megatron_async.kernels.triton_prefill_common import HOPPER_LONG, PrefillLaunch, fitted_launch, prefill_launch
from tests.helpers.paged_attention_cases import PagedCase, make_case

BAD_ERROR = 3e-2
"""A launch whose largest error is past this (bf16 outputs of unit-variance values) is marked wrong."""


def cases() -> dict[str, list[tuple[int, int]]]:
    """(cached, new) rows of the five steps, the last workload A's mixed step (prompts
    of 100-1,024 tokens, every third after a cached first half, beside 120 decode rows of 128-1,152
    keys, 8,192 tokens)."""
    gen = torch.Generator().manual_seed(3)
    decode = [(int(n) - 1, 1) for n in torch.randint(512, 2049, (64,), generator=gen)]
    mixed_a = prompt_rows(8192 - 120, 100, 1024, gen) + [(int(n) - 1, 1) for n in torch.randint(128, 1153, (120,),
                                                                                               generator=gen)]
    return {"8k": [(0, 8192)], "4x2k": [(0, 2048)] * 4, "8x1k+64dec": [(0, 1024)] * 8 + decode,
            "8k@4k": [(4096, 8192)], "A-mixed": mixed_a}


def L(rows: int, block_n: int, warps: int, stages: int, maxnreg: int = 0, kernel: str = "pointer",
      ws: bool = False) -> PrefillLaunch:
    return PrefillLaunch(rows, block_n, warps, stages, maxnreg, kernel, ws)


def candidates(block_size: int) -> list[PrefillLaunch | None]:
    """The launches swept at pages of ``block_size`` tokens; None: the default (``prefill_launch``)
    (``prefill_launch``). Two warpgroups of 128 x 64 tiles under register caps (uncapped the compiler
    leaves room for one program an SM; ``HOPPER_LONG`` is the 128-register one), their neighbours in
    keys and stages, the wide kernel (with and without warp specialization) under the same cap, and
    where pages hold a tile the TMA kernel."""
    out: list[PrefillLaunch | None] = [None, HOPPER_LONG]
    if block_size == 16:
        out += [L(128, 64, 8, 3, cap) for cap in (96, 112, 144, 168)]
        out += [L(128, 64, 8, 2, 128), L(128, 64, 8, 4, 128), L(128, 32, 8, 3, 128), L(128, 128, 8, 2, 128),
                L(128, 128, 8, 2, 168), L(64, 64, 4, 3, 128)]
        out += [L(128, 64, 8, 3, 128, kernel="wide"), L(128, 64, 8, 3, 128, kernel="wide", ws=True)]
        return out
    out += [L(128, 64, 4, 3, kernel="tma"), L(128, 64, 8, 3, 128, kernel="tma"), L(128, 64, 8, 4, 128, kernel="tma"),
            L(128, 64, 8, 3, 128, kernel="tma", ws=True)]
    if block_size >= 128:
        out += [L(128, 128, 8, 2, 128, kernel="tma"), L(128, 128, 8, 2, 168, kernel="tma")]
    return out


def label(launch: PrefillLaunch) -> str:
    cap = launch.maxnreg or "-"
    return (f"{launch.kernel}{'+ws' if launch.warp_specialize else ''} {launch.rows}x{launch.block_n} "
            f"w{launch.num_warps} s{launch.num_stages} r{cap}")


def reference(case: PagedCase, chunk: int = 1024) -> torch.Tensor:
    """Float32 causal attention of each row's queries over its paged keys (after the append), a chunk
    of queries at a time (the torch backend's padded [rows, queries, keys] scores would not fit)."""
    meta, (k_cache, v_cache) = case.meta, case.kv_cache.float()
    num_heads, kv_heads = case.q.shape[1], k_cache.shape[2]
    out = torch.empty(case.q.shape, dtype=torch.float32, device=case.q.device)
    cu, lens = meta.cu_query_lens.tolist(), meta.kv_lens.tolist()
    for r in range(meta.num_rows):
        blocks = meta.block_table[r, : -(-lens[r] // meta.block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[: lens[r]].repeat_interleave(num_heads // kv_heads, dim=1)
        v = v_cache[blocks].flatten(0, 1)[: lens[r]].repeat_interleave(num_heads // kv_heads, dim=1)
        keys = torch.arange(lens[r], device=k.device)
        for t0 in range(cu[r], cu[r + 1], chunk):
            t1 = min(t0 + chunk, cu[r + 1])
            scores = torch.einsum("qhd,khd->hqk", case.q[t0:t1].float(), k) * case.scale
            visible = keys[None, :] <= meta.positions[t0:t1, None]
            probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
            out[t0:t1] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def build(rows: list[tuple[int, int]], heads: tuple[int, int], block_size: int, head_dim: int) -> PagedCase:
    case = make_case(rows, block_size=block_size, seed=5, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, dtype=torch.bfloat16, device="cuda")
    attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)  # append the new keys
    return case


def measure(launch: PrefillLaunch | None, steps: list, iters: int, flashinfer_rows: bool = False
            ) -> tuple[list[float], float] | str:
    """(TFLOP/s per step, largest error) of one launch, or why it failed. ``flashinfer_rows``: the
    engine's long-tile step with FlashInfer's FA3 kernel (its long rows on FA3, one-token rows on the
    decode kernel, the rest on ``launch``)."""
    tflops, err = [], 0.0
    try:
        for case, ref, flops, _ in steps:
            meta = dataclasses.replace(case.meta, long_tiles=True) if flashinfer_rows else case.meta
            fn = functools.partial(prefill_attention, case.q, case.kv_cache, meta, case.scale, launch=launch,
                                   flashinfer_rows=flashinfer_rows)
            err = max(err, (fn().float() - ref).abs().max().item())
            tflops.append(flops / (graph_ms(fn, iters) * 1e-3) / 1e12)
    except Exception as e:  # noqa: BLE001 (out of resources, a compile error, an unusable variant)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:70] if str(e) else ''}"
    return tflops, err


PEERS = {"torch SDPA cuDNN": SDPBackend.CUDNN_ATTENTION, "torch SDPA flash": SDPBackend.FLASH_ATTENTION}


def peer(backend: SDPBackend, case: PagedCase, rows: list[tuple[int, int]], ref: torch.Tensor, flops: float,
         iters: int) -> tuple[float, float] | None:
    """(TFLOP/s, largest error) of torch SDPA on ``backend`` over the step's fresh prompts of one
    length, batched, their new K / V contiguous; None for a step with cached keys or rows of
    several lengths (decode rows)."""
    if any(cached for cached, _ in rows) or len({new for _, new in rows}) != 1:
        return None
    batch, length = len(rows), rows[0][1]

    def heads_first(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, length, t.shape[1], t.shape[2]).transpose(1, 2)

    q, k, v = heads_first(case.q), heads_first(case.k), heads_first(case.v)

    def fn() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case.scale, enable_gqa=True)

    err = (fn().transpose(1, 2).reshape(ref.shape).float() - ref).abs().max().item()
    return flops / (graph_ms(fn, iters) * 1e-3) / 1e12, err


def peer_rows(steps: list, iters: int) -> list[tuple]:
    """One result row per SDPA backend (``PEERS``): TFLOP/s per step, NaN where it does not apply."""
    out = []
    for name, backend in PEERS.items():
        tflops, err = [], 0.0
        try:
            for case, ref, flops, rows in steps:
                got = peer(backend, case, rows, ref, flops, iters)
                tflops.append(math.nan if got is None else got[0])
                err = max(err, 0.0 if got is None else got[1])
        except Exception as e:  # noqa: BLE001 (a backend this build or device lacks)
            print(f"  {name:<48} failed: {type(e).__name__}: {str(e).splitlines()[0][:70] if str(e) else ''}")
            continue
        print(f"  {name:<48} " + " ".join(f"{t:6.0f}" for t in tflops) + f"  {err:.1e}", flush=True)
        out.append((name, tflops, err, False, True))
    return out


def sweep(heads: tuple[int, int], block_size: int, iters: int, kernels: list[str], head_dim: int) -> list[tuple]:
    """Every candidate launch on the steps at one head shape, head_dim and page size; prints a row each."""
    group = heads[0] // heads[1]
    default = prefill_launch(group, head_dim, block_size, torch.device("cuda"))
    limits = launch_limits.device_limits(torch.device("cuda"))
    steps = []
    for rows in cases().values():
        case = build(rows, heads, block_size, head_dim)
        steps.append((case, reference(case), attention_flops(rows, heads[0], head_dim), rows))
    names = list(cases())
    print(f"\nheads {heads[0]}/{heads[1]}, head_dim {head_dim}, pages of {block_size} tokens: TFLOP/s on "
          f"{', '.join(names)}; max error", flush=True)
    results, seen = [], set()
    for launch in candidates(block_size):
        asked = launch or default
        if asked.kernel not in kernels and launch not in (None, HOPPER_LONG):
            continue
        name = ("default " if launch is None else "") + label(asked)
        ran = fitted_launch(asked, 1 << (group - 1).bit_length(), head_dim, 2, 2, limits)
        if ran in seen:  # shrunk to a launch already timed
            continue
        seen.add(ran)
        if ran != asked:
            name += f" (ran {ran.rows}x{ran.block_n} s{ran.num_stages})"
        got = measure(launch, steps, iters)
        if isinstance(got, str):
            print(f"  {name:<48} failed: {got}", flush=True)
            continue
        tflops, err = got
        flag = "  WRONG" if not err <= BAD_ERROR else ""
        print(f"  {name:<48} " + " ".join(f"{t:6.0f}" for t in tflops) + f"  {err:.1e}{flag}", flush=True)
        results.append((name, tflops, err, launch is None, False))
    if flashinfer_prefill.unusable(torch.device("cuda"), torch.bfloat16, head_dim) is None:
        name = "FlashInfer FA3 + decode kernel + long-tile launch"
        got = measure(None, steps, iters, flashinfer_rows=True)  # the rest on the engine's long-tile launch
        if isinstance(got, str):
            print(f"  {name:<48} failed: {got}", flush=True)
        else:
            print(f"  {name:<48} " + " ".join(f"{t:6.0f}" for t in got[0]) + f"  {got[1]:.1e}", flush=True)
            results.append((name, got[0], got[1], False, False))
    return results + (peer_rows(steps, iters) if block_size == 16 else [])


def short_table(tables: dict[tuple, list[tuple]], best: int = 5) -> None:
    print("\n| heads | head_dim | page | launch | " + " | ".join(cases()) + " | mean | max err |")
    print("|---|---:|---:|---|" + "---:|" * (len(cases()) + 2))
    for (heads, head_dim, block_size), results in tables.items():
        ranked = sorted((r for r in results if not r[3] and not r[4] and r[2] <= BAD_ERROR),
                        key=lambda r: -math.fsum(r[1]))[:best]
        for name, tflops, err, _, peer_row in [r for r in results if r[3]] + ranked + [r for r in results if r[4]]:
            mean = "n/a" if peer_row else f"{math.fsum(tflops) / len(tflops):.0f}"
            print(f"| {heads[0]}/{heads[1]} | {head_dim} | {block_size} | {name} | "
                  + " | ".join("n/a" if math.isnan(t) else f"{t:.0f}" for t in tflops) + f" | {mean} | {err:.1e} |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 8, 32, 8],
                        help="pairs of query / KV heads (default: 16 8 and 32 8)")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 128], help="KV page sizes, tokens")
    parser.add_argument("--kernels", nargs="+", default=["pointer", "wide", "tma"],
                        help="the variants to sweep (the default launch and HOPPER_LONG always run)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])


def run(args: argparse.Namespace) -> None:
    if len(args.heads) % 2:
        raise SystemExit("--heads takes pairs of query / KV heads")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in float32
    tables = {}
    for heads in zip(args.heads[::2], args.heads[1::2]):
        for head_dim in args.head_dims:
            for block_size in args.block_sizes:
                tables[(heads, head_dim, block_size)] = sweep(heads, block_size, args.iters, args.kernels, head_dim)
                torch.cuda.empty_cache()
    short_table(tables)
