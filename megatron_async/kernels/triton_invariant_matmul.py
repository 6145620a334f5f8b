"""Batch-invariant linear layer: ``x @ weight.T + bias`` whose every output row is computed
the same way whatever the number of rows.

cuBLAS picks its algorithm (tile shape, split-K, stream-K) from M, the number of rows, so
the bits of one row change with the batch around it. Here the K order depends only on the
weight's shape (N, K) and the device, never on M: every output element walks its K range in
BLOCK_K steps of the same tensor-core instruction (Hopper's wgmma, k16, float32 accumulator),
the K split's ranges are added in range order, and the bias is added in float32 before one
rounding. A row's result is then a function of that row and the weight only: equal bits at
batch 1, 7 or 8192, in eager mode or a CUDA graph. The output tiling (BLOCK_M x BLOCK_N, warps,
stages) only says which program computes an element, so ``launch_tiles`` picks it by row count
(an element's arithmetic is the same instruction chain in a 64 x 32 or a 128 x 128 tile: the
``gpu`` tests compare 1-, 64- and 8,192-row results bit for bit, and ``kernel-times
invariant-kernels`` every launch it times with the 64-row one).

M is excluded from Triton's integer specialisation so that one compiled kernel serves
every row count. Runs on CPU under ``TRITON_INTERPRET=1`` (tests), where ``tl.dot`` is numpy's
matmul of fixed-shape tiles: row-invariant in the tests (batch 1 / 7 / 64, shuffled rows), an
observed property of BLAS on fixed shapes rather than a promise. torch's own CPU matmul is not
row-invariant in float32 (MKL takes another path for one row: results move by ~1e-5), which
is why the mode needs Triton on CPU too."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_async.kernels import launch_limits
from megatron_async.kernels import triton_tma_linear as tma
from megatron_async.kernels.triton_act import silu_mul
from megatron_async.kernels.triton_gemm_common import grouped_tile
from megatron_async.kernels.triton_paged_common import dot_args, num_compute_units


@triton.jit
def _k_step(acc, a_rows, w_cols, k, m_mask, n_mask, k_end, stride_ak, stride_wk,
            DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """``acc`` plus the tile's products over the BLOCK_K columns ``k`` (below ``k_end``). EVEN_K
    (every range whole BLOCK_K tiles): no k mask, the same values, and the loads vectorise (a
    per-element k mask made them 2-byte loads: ~900 instructions per k step of a 64 x 128 tile)."""
    if EVEN_K:
        a_mask = m_mask[:, None]
        w_mask = n_mask[None, :]
    else:
        a_mask = m_mask[:, None] & (k < k_end)[None, :]
        w_mask = (k < k_end)[:, None] & n_mask[None, :]
    # Out-of-range rows / k load 0: they add exact zeros to the real rows' sums.
    a = tl.load(a_rows + k[None, :] * stride_ak, mask=a_mask, other=0.0)
    w = tl.load(w_cols + k[:, None] * stride_wk, mask=w_mask, other=0.0)
    return tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)


@triton.jit
def _k_range(a_rows, w_cols, offs_k, m_mask, n_mask, k_lo, k_end, stride_ak, stride_wk,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """The float32 sum over k in [k_lo, k_end) of one output tile, from zero, BLOCK_K at a time."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_end, BLOCK_K):
        acc = _k_step(acc, a_rows, w_cols, k0 + offs_k, m_mask, n_mask, k_end, stride_ak, stride_wk,
                      DOT_DTYPE, DOT_PRECISION, EVEN_K)
    return acc


@triton.jit
def _k_ranges(a_rows, w_cols, offs_k, m_mask, n_mask, K, stride_ak, stride_wk, K_PER_SPLIT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr):
    """``_k_range`` of every range of K_PER_SPLIT (a multiple of BLOCK_K), added in range order, in
    one loop over K: the loads stay pipelined across a range's end, where a loop per range drained
    and refilled the pipeline. The sum starts at -0.0 (-0.0 + x is x, bit for bit), so it is the
    split-sum kernel's r0 + r1 + ... exactly."""
    acc = tl.full([BLOCK_M, BLOCK_N], -0.0, tl.float32)
    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the ranges are whole BLOCK_K tiles: only K's own end cuts a tile
        part = _k_step(part, a_rows, w_cols, k0 + offs_k, m_mask, n_mask, K, stride_ak, stride_wk,
                       DOT_DTYPE, DOT_PRECISION, EVEN_K)
        if ((k0 + BLOCK_K) % K_PER_SPLIT == 0) | (k0 + BLOCK_K >= K):  # a range ends: add it, start the next
            acc += part
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    c_ptr,
    ws_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_cm,
    K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IN_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m[:, None] * stride_am
    w_cols = w_ptr + offs_n[None, :] * stride_wn
    mask = m_mask[:, None] & n_mask[None, :]
    if IN_PROGRAM:  # every K range here, added in range order: the split-sum kernel's arithmetic
        acc = _k_ranges(a_rows, w_cols, offs_k, m_mask, n_mask, K, stride_ak, stride_wk, K_PER_SPLIT,
                        BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, EVEN_K)
    else:
        split = tl.program_id(1)
        acc = _k_range(a_rows, w_cols, offs_k, m_mask, n_mask, split * K_PER_SPLIT,
                       tl.minimum(K, (split + 1) * K_PER_SPLIT), stride_ak, stride_wk,
                       BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, EVEN_K)
    if SPLIT_K == 1 or IN_PROGRAM:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:  # float32 partial of this K range; _split_sum_kernel adds them in split order
        tl.store(ws_ptr + (tl.program_id(1) * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _split_sum_kernel(ws_ptr, bias_ptr, c_ptr, M, N, stride_cm, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    # One element's partials are always added in the same order: split 0, 1, ..., then bias.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + (offs // N) * stride_cm + n, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _swiglu_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, I, K, stride_am, stride_ak, stride_wn, stride_wk, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """silu(gate) * up of a [gate | up] weight [2I, K]: the gate and up tiles of one output tile,
    each the float32 K sum ``_matmul_kernel`` computes for that column (same tiles, same order),
    plus bias, rounded to the output dtype, then ``silu_mul``: the unfused path's bits."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(I, BLOCK_N), GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < I
    a_rows = a_ptr + offs_m[:, None] * stride_am
    dt = c_ptr.dtype.element_ty
    gate = _k_range(a_rows, w_ptr + offs_n[None, :] * stride_wn, offs_k, m_mask, n_mask, 0, K, stride_ak, stride_wk,
                    BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, EVEN_K)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    gate = gate.to(dt)  # held rounded while the up tile runs, as the unfused GEMM stores it
    up = _k_range(a_rows, w_ptr + (I + offs_n)[None, :] * stride_wn, offs_k, m_mask, n_mask, 0, K, stride_ak,
                  stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, EVEN_K)
    if HAS_BIAS:
        up += tl.load(bias_ptr + I + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = silu_mul(gate.to(tl.float32), up.to(dt).to(tl.float32), dt)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    """K is cut into this many fixed ranges (a function of K, never of M); their float32
    partials are summed in range order by a second kernel."""
    num_warps: int
    num_stages: int


def tile_config(n: int, k: int, device: torch.device) -> TileConfig:
    """Tiles for an [N, K] weight. A function of (N, K, device) ONLY: the invariance of
    the whole mode rests on M never reaching its K order (block_k, split_k); ``launch_tiles``
    keeps that order and may retile the output for the row count.

    GPU: 64-row tiles (a decode batch of ~128 fills two), 128 columns for wide weights
    (QKV, gate_up, LM head), 64 for narrow ones (o_proj, down_proj). Narrow weights with a
    long K (o_proj, down_proj) also cut K into up to 4 fixed ranges: at decode batch sizes
    they would otherwise run only ~32 programs, each walking all of K alone. CPU
    (interpreter): tiles that tiny test shapes still cross in M, N and K (and a split for
    narrow weights), yet few programs (the interpreter pays per program)."""
    if device.type != "cuda":
        return TileConfig(32, 64, 32, 2 if n <= 64 and k > 32 else 1, 1, 1)
    narrow = n < 4096
    split = max(1, min(4, k // 512)) if narrow else 1
    return TileConfig(64, 64 if narrow else 128, 64, split, 4, 4)


PREFILL_TILES = {"linear": (128, 128, 8, 3), "swiglu": (128, 128, 8, 4), "split": (128, 64, 8, 4)}
"""(BLOCK_M, BLOCK_N, warps, stages) of ``launch_tiles`` at prefill row counts: plain linears, the
fused SwiGLU, and weights whose K ranges one program adds (two float32 accumulators: 128 x 128 on
8 warps spills). The fastest of ``kernel-times invariant-kernels --sweep``; H100, 8,192 rows of the
0.6B, us against 64-row tiles: qkv 137.0 vs 184.3, gate_up 225.5 vs 254.0, o_proj 109.0 vs 120.8,
down 153.4 vs 178.2."""
DECODE_ROWS = 128
"""Up to this many rows (decode batches) no 128-row tiles; a launch that would leave the device
short of work takes 32-column tiles."""


def launch_tiles(m: int, n: int, k: int, device: torch.device, swiglu: bool = False) -> TileConfig:
    """``tile_config`` for m rows (``swiglu``: the fused kernel's, n // 2 output columns): its K order
    (block_k, split_k) always, its output tiling unless, on GPU, another fills the device better:
    past ``DECODE_ROWS`` rows 128-row tiles on 8 warps (two wgmma warpgroups, each the 64-row
    instruction chain of the small tiles) once they alone fill it twice; up to it 32 columns
    instead of 64-128 where the programs would not fill it twice (128 rows of the 0.6B, us: qkv 7.9
    vs 9.1, gate_up 12.3 vs 14.8, o_proj 7.2 vs 7.6, down 8.3 vs 8.9; the LM head keeps its tiles).
    Only which program computes an element changes with m."""
    cfg = tile_config(n, k, device)
    if device.type != "cuda":
        return cfg
    cols = n // 2 if swiglu else n
    fill = 2 * num_compute_units(device)
    block_m, block_n, warps, stages = PREFILL_TILES["swiglu" if swiglu else "split" if cfg.split_k > 1 else "linear"]
    if m <= DECODE_ROWS:
        short = triton.cdiv(m, cfg.block_m) * triton.cdiv(cols, cfg.block_n) * cfg.split_k < fill
        return dataclasses.replace(cfg, block_n=32) if short else cfg
    if triton.cdiv(m, block_m) * triton.cdiv(cols, block_n) >= fill:
        return dataclasses.replace(cfg, block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
    return cfg


def footprint(elem_bytes: int, swiglu: bool = False):
    """An A tile and one (two: gate and up) weight tiles a step; two accumulators where K ranges are
    added in one program or gate and up are held."""
    def of(cfg: TileConfig) -> launch_limits.Footprint:
        f = launch_limits.gemm_footprint(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.num_warps,
                                         elem_bytes, elem_bytes, 2 if swiglu else 1, elem_bytes)
        return dataclasses.replace(f, accumulators=cfg.block_m * cfg.block_n * (2 if swiglu or cfg.split_k > 1 else 1))
    return of


def fitted_tiles(cfg: TileConfig, elem_bytes: int, limits: launch_limits.DeviceLimits,
                 swiglu: bool = False) -> TileConfig:
    """``cfg`` on the most stages ``limits`` hold (stages never change the bits)."""
    return launch_limits.fit(cfg, footprint(elem_bytes, swiglu), limits)


def _check_tiles(tiles: TileConfig, n: int, k: int, device: torch.device) -> TileConfig:
    """An explicit launch (benchmark sweeps, tests) may change the output tiling, never the K order."""
    base = tile_config(n, k, device)
    if (tiles.block_k, tiles.split_k) != (base.block_k, base.split_k):
        raise ValueError(f"tiles {tiles} change the K order of a [{n}, {k}] weight ({base.block_k}, {base.split_k})")
    return tiles


def splits_in_program(m: int, n: int, cfg: TileConfig, device: torch.device) -> bool:
    """Whether one program runs all K ranges of its tile (adding them in range order, as the split-sum
    kernel does: the same bits) instead of a program per range plus the sum kernel. Yes once the
    output tiles alone fill the device twice (a prefill step: no float32 partials through memory,
    ~0.5 GB a layer of the 0.6B at 8,192 rows); decode batches keep a program per range."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return cfg.split_k > 1 and tiles >= 2 * num_compute_units(device)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     in_program: bool | None = None, tiles: TileConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with row-count-independent numerics (see the module
    docstring). x: [..., K]; weight: [N, K]; bias: [N] or None. Returns [..., N] in x's dtype.
    ``in_program``: force where the K ranges are added (tests), else ``splits_in_program``.
    ``tiles``: the launch (tests, sweeps; the K order of ``tile_config``), else ``launch_tiles``."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"invariant_linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype)):
        raise ValueError(f"invariant_linear: dtypes/shapes x {x.dtype}, weight {weight.dtype}, "
                         f"bias {None if bias is None else (tuple(bias.shape), bias.dtype)}")
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1])
    n, k = weight.shape
    m = a.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        return (out.zero_() if bias is None else out.copy_(bias.expand(m, n))).reshape(*lead, n)
    cfg = launch_tiles(m, n, k, x.device) if tiles is None else _check_tiles(tiles, n, k, x.device)
    cfg = fitted_tiles(cfg, x.element_size(), launch_limits.device_limits(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    if in_program is None:
        in_program = splits_in_program(m, n, cfg, x.device)
    in_program = in_program and split > 1
    if tiles is None and (split == 1 or in_program) and tma.takes(a, weight):
        # prefill rows: the same bits, TMA loads, a persistent grid
        return tma.tma_linear(a, weight, bias, k_per_split, split > 1).reshape(*lead, n)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 and not in_program else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), 1 if in_program else split)
    bias_arg = weight if bias is None else bias
    _matmul_kernel[grid](
        a, weight, bias_arg, out, ws,
        m, n, k, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        K_PER_SPLIT=k_per_split, SPLIT_K=split, IN_PROGRAM=in_program, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8, HAS_BIAS=bias is not None,
        **dot_args(_matmul_kernel, x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1 and not in_program:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](ws, bias_arg, out, m, n, out.stride(0), SPLIT_K=split,
                                                       HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out.reshape(*lead, n)


def takes_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``invariant_swiglu`` computes these operands (else the caller runs the unfused path)."""
    n, k = weight.shape
    if (x.dim() != 2 or x.shape[1] != k or n % 2 or x.dtype != weight.dtype or k == 0
            or (bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype))):
        return False
    return tile_config(n, k, x.device).split_k == 1


def invariant_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     tiles: TileConfig | None = None) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``invariant_linear(x, weight, bias)`` split into [gate | up] halves,
    in one kernel: the same bits without the [T, 2I] projection written and read back (~200 MB a
    layer of the 0.6B on an 8,192-token step). None where the weight's tiles cut K (``tile_config``;
    a function of the weight only, so a layer always takes the same path) or the operands do not
    fit (x [T, K] of the weight's dtype, an even number of weight rows). ``tiles``: as for
    ``invariant_linear``."""
    if not takes_swiglu(x, weight, bias):
        return None
    n, k = weight.shape
    m, inter = x.shape[0], n // 2
    cfg = launch_tiles(m, n, k, x.device, swiglu=True) if tiles is None else _check_tiles(tiles, n, k, x.device)
    cfg = fitted_tiles(cfg, x.element_size(), launch_limits.device_limits(x.device), swiglu=True)
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m == 0 or inter == 0:
        return out
    _swiglu_kernel[(triton.cdiv(m, cfg.block_m) * triton.cdiv(inter, cfg.block_n),)](
        x, weight, weight if bias is None else bias, out, m, inter, k, x.stride(0), x.stride(1), weight.stride(0),
        weight.stride(1), out.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, **dot_args(_swiglu_kernel, x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
