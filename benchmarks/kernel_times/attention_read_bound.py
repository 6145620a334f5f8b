"""How far the decode attention is from reading its bytes: the device's read rate on one flat
buffer (the best of a few grids), the attention's own access pattern read alone (the decode
kernel's grid of (KV head, row) programs walking the row's pages in key tiles, summing K and V
instead of attending), and the decode kernel itself, at workload A's rows (128 rows of
100-1,152 keys, longest first), for KV blocks of 16 and 64 tokens in the engine's layout (a
token's KV heads side by side: NHD) and with each KV head's tokens side by side (HND, as a
strided view the kernel reads unchanged). us per call, 10 calls a graph.

    python -m benchmarks kernel-times attention-read-bound [--iters 20]"""
from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

from benchmarks.cuda_timing import graph_call_us
from benchmarks.roofline import measure_copy_bandwidth
from benchmarks.kernel_times.paged_attention import decode_case, longest_first_lens
from megatron_async.kernels.triton_decode_attention import decode_attention
from megatron_async.kernels.triton_paged_common import kv_tile_rows, load_kv
from tests.helpers.paged_attention_cases import PagedCase


@triton.jit
def _read_flat_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEP: tl.constexpr):
    """Each program sums every STEP-th BLOCK of x: a grid-strided read of the whole buffer."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, STEP):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _read_pattern_kernel(k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, stride_bt, stride_cb, stride_cs, stride_ch,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The decode kernel's loads without its arithmetic: program (KV head, row) sums the row's keys
    and values of its head, tile by tile, into out[row, head]."""
    kv_head = tl.program_id(0)
    row = tl.program_id(1)
    end = tl.load(lens_ptr + row).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM
    table = table_ptr + row.to(tl.int64) * stride_bt
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        n_mask = n0 + tl.arange(0, BLOCK_N) < end
        rows = kv_tile_rows(table, n0, end, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N, True)
        k = load_kv(k_ptr, rows, offs_d, n_mask, d_mask)
        v = load_kv(v_ptr, rows, offs_d, n_mask, d_mask)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    tl.store(out_ptr + row * tl.num_programs(0) + kv_head, tl.sum(acc, 0))


def read_pattern(kv_cache: torch.Tensor, case: PagedCase, block_n: int, num_warps: int = 4,
                 num_stages: int = 3) -> torch.Tensor:
    """[rows, KV heads]: the sum of each row's keys and values of each KV head (what
    ``_read_pattern_kernel`` reads: the decode kernel's bytes in its order)."""
    k, v = kv_cache[0], kv_cache[1]
    meta, num_kv_heads, head_dim = case.meta, kv_cache.shape[3], kv_cache.shape[4]
    out = torch.empty(meta.num_rows, num_kv_heads, device=kv_cache.device, dtype=torch.float32)
    _read_pattern_kernel[(num_kv_heads, meta.num_rows)](
        k, v, meta.block_table, meta.kv_lens, out, meta.block_table.stride(0), k.stride(0), k.stride(1), k.stride(2),
        BLOCK_SIZE=meta.block_size, BLOCK_N=block_n, HEAD_DIM=head_dim, num_warps=num_warps, num_stages=num_stages)
    return out


def heads_major(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache's values with each block's KV heads outermost (HND storage), seen in the
    kernel's [2, blocks, block_size, KV heads, head_dim] index order."""
    return kv_cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)


def flat_read_gbps(nbytes: int = 1 << 30) -> tuple[float, str]:
    """The best read rate over a few grids (programs x elements a load) of one bf16 buffer."""
    n = nbytes // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    best, where = 0.0, ""
    for programs in (528, 1056, 2112):
        for block in (2048, 4096):
            out = torch.empty(programs, device="cuda")
            fn = functools.partial(_read_flat_kernel[(programs,)], x, out, n, BLOCK=block, STEP=programs * block,
                                   num_warps=8)
            gbps = nbytes / graph_call_us([fn], calls_per_graph=5, replays=5) / 1e3
            if gbps > best:
                best, where = gbps, f"{programs} programs x {block}"
    return best, where


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=int, default=20, help="graph replays per timing")


def run(args: argparse.Namespace) -> None:
    lens, iters = longest_first_lens(128, 100, 1152), args.iters
    copy = measure_copy_bandwidth(torch.device("cuda")) / 1e9
    flat, where = flat_read_gbps()
    print(f"\ndecode attention against its read bound: {len(lens)} rows, KV {min(lens)}-{max(lens)} tokens; "
          f"copy {copy:,.0f} GB/s, flat read {flat:,.0f} GB/s ({where})")
    print("| KV block | layout | what | us | KV GB/s | x flat read | bits == NHD |\n|---:|---|---|---:|---:|---:|---|")
    for block_size in (16, 64):
        case, kv_bytes = decode_case(lens, block_size)
        base = decode_attention(case.q, case.kv_cache, case.meta, case.scale)
        for layout, cache in (("NHD", case.kv_cache), ("HND", heads_major(case.kv_cache))):
            timed = [(f"read alone, {n}-key tiles", functools.partial(read_pattern, cache, case, n)) for n in (64, 128)]
            timed.append(("decode kernel", functools.partial(decode_attention, case.q, cache, case.meta, case.scale)))
            for what, fn in timed:
                us = graph_call_us([fn], calls_per_graph=10, replays=iters)
                same = str(torch.equal(fn(), base)) if what == "decode kernel" else ""
                gbps = kv_bytes / us / 1e3
                print(f"| {block_size} | {layout} | {what} | {us:.1f} | {gbps:,.0f} | {gbps / flat:.3f} | {same} |")
        del case
        torch.cuda.empty_cache()
