"""A disaggregated hand-off's KV chunks (kv_layout.py): a Qwen3-8B-shaped pool (36 layers, 8 KV
heads of 128, 16-token blocks, bf16: 2.25 MiB a block) on the prefill GPU and another on the
decode GPU (the second GPU when there is one, else the same). Per chunk size: the gather into a
staging buffer and the scatter out of one, with the per-layer torch ops (36 index_select / 36
index_copy_) and with the one-launch Triton kernel (triton_kv_chunk.py), next to a plain copy of
the chunk's bytes between the two staging buffers (the wire's floor on one host); then a whole
request (4,608 tokens: 288 blocks, 648 MiB) moved chunk after chunk, gather -> copy -> scatter,
against one plain copy of its bytes. Block ids are a random permutation (an allocator's
scattered blocks). "same": the kernel wrote the torch ops' bytes and every block landed.

With ``--nccl`` (two GPUs) the same request also goes through the engine's own transfer code
(kv_stream.send_blocks / recv_blocks, two processes, one NCCL pair, each on a side stream as a
connection's thread is): with the torch ops, with the kernel, and the bare chunk sends without
gather or scatter, next to one NCCL send of all its bytes, so the wire's share shows.

Read: the request's ``kernel / copy`` (the target is <= 2x) and the per-chunk ms of each side.

    python -m benchmarks kernel-times kv-chunks [--chunk-mib 32 64 128] [--iters 20] [--nccl]"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from benchmarks.cuda_timing import median_ms
from megatron_async.disaggregation.kv_layout import KVLayout

LAYERS, HEADS, HEAD_DIM, BLOCK = 36, 8, 128, 16
REQUEST_BLOCKS = 288
POOL_BLOCKS = 320


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--one-gpu", action="store_true", help="both pools on one GPU even when there are two")
    parser.add_argument("--nccl", action="store_true", help="also the engine's transfer code over a NCCL pair")


def _pool(device: torch.device, seed: int) -> SimpleNamespace:
    g = torch.Generator(device=device).manual_seed(seed)
    caches = [torch.randn(2, POOL_BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=g, device=device).to(torch.bfloat16)
              for _ in range(LAYERS)]
    return SimpleNamespace(kv_caches=caches, mamba=None)


def _wall_ms(fn, iters: int, devices: list[torch.device]) -> float:
    """Median over 5 rounds of ``iters`` calls, host clock between device syncs (work on two GPUs)."""
    fn()
    rounds = []
    for _ in range(5):
        for d in devices:
            torch.cuda.synchronize(d)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        for d in devices:
            torch.cuda.synchronize(d)
        rounds.append((time.perf_counter() - start) / iters * 1e3)
    return statistics.median(rounds)


def _on(device: torch.device, fn, iters: int) -> float:
    with torch.cuda.device(device):
        return median_ms(fn, iters)


def run(args: argparse.Namespace) -> None:
    src_dev = torch.device("cuda", 0)
    dst_dev = torch.device("cuda", 1 if torch.cuda.device_count() > 1 and not args.one_gpu else 0)
    devices = sorted({src_dev, dst_dev}, key=lambda d: d.index)
    src, dst = _pool(src_dev, 1), _pool(dst_dev, 2)
    layouts = {"torch": (KVLayout(src, one_launch=False), KVLayout(dst, one_launch=False)),
               "kernel": (KVLayout(src, one_launch=True), KVLayout(dst, one_launch=True))}
    size = layouts["torch"][0].block_bytes()
    perm = torch.randperm(POOL_BLOCKS, generator=torch.Generator().manual_seed(0))
    src_ids, dst_ids = perm[:REQUEST_BLOCKS].to(src_dev), perm.flip(0)[:REQUEST_BLOCKS].to(dst_dev)
    print(f"pools on {src_dev} -> {dst_dev}: {LAYERS} layers x [2, {POOL_BLOCKS}, {BLOCK}, {HEADS}, {HEAD_DIM}] bf16, "
          f"{size / 2**20:.2f} MiB a block; request {REQUEST_BLOCKS} blocks ({REQUEST_BLOCKS * size / 2**20:.0f} MiB)")
    whole_a = torch.empty(REQUEST_BLOCKS * size, dtype=torch.uint8, device=src_dev)
    whole_b = torch.empty_like(whole_a, device=dst_dev)
    request_copy = _wall_ms(lambda: whole_b.copy_(whole_a), args.iters, devices)
    rows = []
    for mib in args.chunk_mib:
        chunks = layouts["torch"][0].chunks(REQUEST_BLOCKS, mib << 20)
        n = chunks[0][1]
        staged = {d: [torch.empty(n * size, dtype=torch.uint8, device=d) for _ in range(2)] for d in (src_dev, dst_dev)}
        a, b = staged[src_dev][0], staged[dst_dev][0]
        idx_s, idx_d = src_ids[:n], dst_ids[:n]
        layouts["torch"][0].pack_into(a, idx_s)
        layouts["kernel"][0].pack_into(same := torch.empty_like(a), idx_s)
        row = {"chunk MiB": mib, "blocks": n, "same": torch.equal(same, a),
               "copy": _wall_ms(lambda: b.copy_(a), args.iters, devices)}
        for name, (send, recv) in layouts.items():
            row[f"gather {name}"] = _on(src_dev, lambda: send.pack_into(a, idx_s), args.iters)
            row[f"scatter {name}"] = _on(dst_dev, lambda: recv.scatter(b, idx_d), args.iters)

            def request(send=send, recv=recv):
                for i, (first, k) in enumerate(chunks):
                    out, into = staged[src_dev][i % 2][:k * size], staged[dst_dev][i % 2][:k * size]
                    send.pack_into(out, src_ids[first:first + k])
                    into.copy_(out)
                    recv.scatter(into, dst_ids[first:first + k])
            for t in dst.kv_caches:
                t.zero_()
            row[f"request {name}"] = _wall_ms(request, max(2, args.iters // 4), devices)
            row["same"] = row["same"] and all(torch.equal(d[:, dst_ids].to(src_dev), s[:, src_ids])
                                              for d, s in zip(dst.kv_caches, src.kv_caches))
        rows.append(row)
    _table(rows, request_copy)
    if args.nccl:
        if torch.cuda.device_count() < 2:
            print("--nccl: skipped, one GPU")
            return
        from benchmarks.kv_wire import wire_table
        wire_table(args.chunk_mib, request_copy)


def _table(rows: list[dict], request_copy: float) -> None:
    print(f"\none plain copy of the whole request: {request_copy:.3f} ms")
    print("| chunk MiB | blocks | gather torch | gather kernel | copy | scatter torch | scatter kernel | "
          "request torch | request kernel | torch / copy | kernel / copy | same |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--:|")
    for r in rows:
        print(f"| {r['chunk MiB']} | {r['blocks']} | {r['gather torch']:.3f} | {r['gather kernel']:.3f} | "
              f"{r['copy']:.3f} | {r['scatter torch']:.3f} | {r['scatter kernel']:.3f} | {r['request torch']:.2f} | "
              f"{r['request kernel']:.2f} | {r['request torch'] / request_copy:.1f}x | "
              f"{r['request kernel'] / request_copy:.1f}x | {'yes' if r['same'] else 'NO'} |")
    print(f"(ms; gather / copy / scatter: one chunk; request: {REQUEST_BLOCKS} blocks chunk after chunk, "
          "against one plain copy of its bytes; same: the kernel's bytes are the torch ops', and the blocks landed)")
