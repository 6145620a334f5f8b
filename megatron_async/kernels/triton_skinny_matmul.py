"""Decode-size linear layers: ``x @ W.T (+ bias)`` for few rows (M <= 256), optionally with the
SwiGLU activation of a fused gate_up weight applied in the epilogue.

At decode sizes a linear layer is a weight read: the qwen3-0.6b shapes hold 4-12 MB of weight
each and should take 1.5-4 us at copy bandwidth, but cuBLAS runs them in 5-7 us (launch and
tail bound, see scripts/bench_decode_gemms.py). Narrow outputs (o_proj, down: N = 1024) give a
cuBLAS-style tiling only ~16 output tiles for 132 SMs, each walking all of K. Here K is also cut
into SPLIT_K fixed ranges so that enough programs stream the weight at once. Each range writes
a float32 partial; the last program of a tile to finish (a per-tile arrival counter) adds the
partials in range order 0..SPLIT_K-1, so the sum does not depend on which program came last:
the result is deterministic, and the counter is reset to 0 by that program (graph replays
start from zeros again).

With ``gated`` the weight is [2I, K] (gate rows, then up rows, HF's gate_proj / up_proj
stacked) and the output is ``silu(gate) * up``, [M, I], rounded like the unfused path
(gate and up rounded to the output dtype, silu in float32 rounded, the product rounded): the
[M, 2I] intermediate and one launch per layer are gone.

The tile configuration is a function of (M bucket, N, K, device): serial and launch-ahead
engines, and a graph and its eager twin at the same padded M, run identical arithmetic."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_paged_common import dot_args

MAX_ROWS = 256
"""Row counts above this go to cuBLAS: at prefill sizes the GEMM is compute bound."""


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    a_ptr, w_ptr, bias_ptr, c_ptr, ws_ptr, count_ptr,
    M, N, K, stride_am, stride_wn, stride_cm,
    K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = 0, PREFETCH_LINES: tl.constexpr = 1,
):
    # N = output columns (I when gated; the up rows of W start at row N).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    g_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = w_ptr + (offs_n + N).to(tl.int64)[:, None] * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_first = split * K_PER_SPLIT
    if PDL >= 2:
        # weights never depend on the kernel before: pull this program's slab into L2 meanwhile
        lines = tl.minimum(k_first + tl.arange(0, PREFETCH_LINES) * 64, K - 64)
        slab = g_rows + lines[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [slab], dtype=tl.int32,
                                  is_pure=False, pack=1)
        if GATED:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [u_rows + lines[None, :]],
                                      dtype=tl.int32, is_pure=False, pack=1)
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()  # the activation (and anything written below) waits for the kernel before
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in range(k_first, k_first + K_PER_SPLIT, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            k_mask = offs_k < BLOCK_K
        else:
            k_mask = k < K
        # rows past M / columns past N load 0: exact zeros in the sums, never stored
        a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
        wg = tl.load(g_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
        acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=DOT_PRECISION)
        if GATED:
            wu = tl.load(u_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
            acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=DOT_PRECISION)

    last = True
    if SPLIT_K > 1:
        # this range's partial -> workspace; the tile's last arrival sums all ranges in order
        num_tiles = tl.num_programs(0) * tl.num_programs(1)
        tile = pid_m * tl.num_programs(0) + pid_n
        cell = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        per_split = num_tiles * BLOCK_M * BLOCK_N
        tile_ws = ws_ptr + tile.to(tl.int64) * BLOCK_M * BLOCK_N + cell
        tl.store(tile_ws + split * per_split, acc_g)
        if GATED:
            tl.store(tile_ws + (SPLIT_K + split) * per_split, acc_u)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:
            acc_g = tl.load(tile_ws, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc_g += tl.load(tile_ws + s * per_split, cache_modifier=".cg")
            if GATED:
                acc_u = tl.load(tile_ws + SPLIT_K * per_split, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    acc_u += tl.load(tile_ws + (SPLIT_K + s) * per_split, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)  # ready for the next call / graph replay
    if last:
        dt = c_ptr.dtype.element_ty
        if HAS_BIAS:
            acc_g += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_u += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = acc_g
        if GATED:  # the unfused path's roundings: gate_up in dt, silu(gate) in dt, product in dt
            gate = acc_g.to(dt).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            out = act * acc_u.to(dt).to(tl.float32)
        c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c, out.to(dt), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    pdl: int = 0
    """Programmatic dependent launch: 0 off, 1 wait for the kernel before at the start and let the
    next kernel launch, 2 also prefetch this program's weight slab into L2 before waiting."""


def row_bucket(m: int) -> int:
    """The M the tile choice sees: the next power of two (>= 16)."""
    return max(16, triton.next_power_of_2(m))


def skinny_config(m: int, n: int, k: int, gated: bool, device: torch.device) -> SkinnyConfig:
    """Tiles for M rows of an [N, K] weight (N = output columns; gated reads 2N weight rows).

    Aim: ~1-2 programs per SM, each streaming a contiguous slab of weight rows, the
    activation tile shared through L2. The whole row bucket is one row tile up to 64 rows
    (larger buckets take two or more); narrow outputs split K."""
    bucket = row_bucket(m)
    if device.type != "cuda":  # interpreter: tiny tiles that cross M, N and K, and a split
        return SkinnyConfig(16, 16, 16, 2 if k >= 64 else 1, 1, 1)
    # H100 sweep at 128 rows (bench_decode_gemms.py --sweep): 64-row tiles, 64 columns for wide
    # outputs, 32 and two K ranges for narrow ones with a long K (o_proj, down)
    narrow = n < 3072
    return SkinnyConfig(min(bucket, 64), 32 if narrow else 64, 128 if k % 128 == 0 else 64,
                        2 if narrow and k >= 2048 else 1)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    # per-tile arrival counters, zero between calls (each call's last arrivals reset them);
    # one compute stream uses them, so calls never overlap
    return torch.zeros(1 << 16, dtype=torch.int32, device=device)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  gated: bool = False, config: SkinnyConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for [M, K] x with M <= MAX_ROWS; ``gated``: weight and bias
    hold [gate; up] and the result is ``silu(gate) * up`` ([M, N/2]). ``config`` overrides the
    tile choice (benchmarks and tests)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError("skinny_linear: needs unit last strides and one dtype for x and weight")
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if gated and weight.shape[0] % 2:
        raise ValueError(f"skinny_linear: a gated weight has an even row count, got {weight.shape[0]}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"skinny_linear: bias {tuple(bias.shape)} {bias.dtype} does not match the weight")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or skinny_config(m, n, k, gated, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    tiles = grid[0] * grid[1]
    counters = _counters(x.device)
    if tiles > counters.numel():
        raise ValueError(f"skinny_linear: {tiles} tiles exceed the counter buffer")
    ws = (torch.empty((2 if gated else 1) * split * tiles * cfg.block_m * cfg.block_n, dtype=torch.float32,
                      device=x.device) if split > 1 else out)
    _skinny_kernel[grid](
        x, weight, weight if bias is None else bias, out, ws, counters,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        K_PER_SPLIT=k_per_split, SPLIT_K=split, EVEN_K=k % k_per_split == 0 and k_per_split % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATED=gated, HAS_BIAS=bias is not None,
        **dot_args(_skinny_kernel, x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"PDL": cfg.pdl, "PREFETCH_LINES": triton.next_power_of_2(max(1, k_per_split // 64)), "launch_pdl": True}
           if cfg.pdl else {}),
    )
    return out
