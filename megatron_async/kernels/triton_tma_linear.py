"""The batch-invariant linear at prefill row counts with TMA loads and a persistent grid.

``triton_invariant_matmul`` fixes each output element's arithmetic: K walked in order through
the k16 tensor-core chain, a weight whose K is cut into ranges summing each range from zero and
adding the ranges in range order, the bias added in float32 before one rounding. Its kernel loads
through pointers and launches a program per tile; on the weights whose K it cuts (o_proj and
down_proj of the 0.6B) a prefill-sized GEMM took 1.9-2.4x cuBLAS's time. This kernel computes the
same chain per element with the default mode's fused MLP kernel's loads (TMA descriptors; one
program per SM walking the tiles in grouped order, ``triton_swiglu_matmul``), so its bits are the
invariant kernel's at every row count (the ``gpu`` tests compare 1- and 64-row calls of that
kernel with 2,048- and 8,192-row calls of this one). H100, us per call in graphs (``kernel-times
invariant-kernels --part matmul``), the invariant kernel / this one / cuBLAS at 8,192 and 2,048
rows: o_proj 90.1 / 70.0 / 47.1 and 30.6 / 19.1 / 13.6, down 138.1 / 100.5 / 68.2 and 44.8 / 26.7 /
18.6, qkv 139.5 / 108.3 / 99.3 and 35.0 / 28.7 / 26.1. A weight without K ranges holds one
accumulator, so its tiles are 128 x 256, as the fused MLP kernel's relu(h)^2 at the same shape; in
128 x 128 tiles qkv gained nothing (139.2 and 37.4 us)."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_async.kernels import cuda_device, launch_limits
from megatron_async.kernels.triton_gemm_common import grouped_tile
from megatron_async.kernels.triton_paged_common import dot_args, num_compute_units

class LinearTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


TILES = {True: LinearTiles(128, 128, 64, 8, 3), False: LinearTiles(128, 256, 64, 8, 3)}
"""(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) with K ranges (two 128 x 128 float32 accumulators on 8
warps, the total and the range's sum, as the fused MLP kernel's SwiGLU holds gate and up) and
without (one 128 x 256, as its relu(h)^2)."""


def footprint(ranges: bool, elem_bytes: int):
    """One A and one B tile a step; with K ranges two accumulators (the total and the range's sum)."""
    def of(t: LinearTiles) -> launch_limits.Footprint:
        f = launch_limits.gemm_footprint(t.block_m, t.block_n, t.block_k, t.num_stages, t.num_warps, elem_bytes,
                                         elem_bytes, out_bytes=elem_bytes)
        return dataclasses.replace(f, accumulators=f.accumulators * (2 if ranges else 1))
    return of


def launch_tiles(ranges: bool, elem_bytes: int, limits: launch_limits.DeviceLimits) -> LinearTiles:
    """``TILES[ranges]`` on the most stages ``limits`` hold (the tiles fix the K order: kept)."""
    return launch_limits.fit(TILES[ranges], footprint(ranges, elem_bytes), limits)


MIN_ROWS = 1024
"""Fewer rows keep the invariant kernel's own launch (``launch_tiles``)."""


@triton.jit(do_not_specialize=["M", "num_programs"])
def _tma_linear_kernel(a_desc, w_desc, bias_ptr, out_desc, M, N, K, num_programs,
                       K_PER_SPLIT: tl.constexpr, RANGES: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``RANGES``: K cut into ranges of K_PER_SPLIT (a multiple of BLOCK_K), each summed from zero
    and added to a total that starts at -0.0 (-0.0 + x is x, bit for bit: the first range's sum
    exactly, as the split-sum kernel takes it); else one sum over K from zero."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_m * num_n, num_programs):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        if RANGES:
            acc = tl.full([BLOCK_M, BLOCK_N], -0.0, tl.float32)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # descriptors load zeros past M, N and K
            a = a_desc.load([pid_m * BLOCK_M, k0]).to(DOT_DTYPE)
            w = w_desc.load([pid_n * BLOCK_N, k0]).to(DOT_DTYPE)
            part = tl.dot(a, w.T, part, input_precision=DOT_PRECISION)
            if RANGES:
                if ((k0 + BLOCK_K) % K_PER_SPLIT == 0) | (k0 + BLOCK_K >= K):  # a range ends
                    acc += part
                    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if not RANGES:
            acc = part
        if HAS_BIAS:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))


def takes(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``invariant_linear`` hands these operands to ``tma_linear``: a Hopper or newer GPU
    (TMA), at least ``MIN_ROWS`` rows, 16-bit types, 16-byte aligned bases and row strides, unit
    stride along K."""
    return (a.shape[0] >= MIN_ROWS and a.is_cuda and cuda_device.capability(a.device)[0] >= 9
            and a.dtype == weight.dtype and a.dtype in (torch.bfloat16, torch.float16)
            and a.stride(1) == 1 and weight.stride(1) == 1 and (weight.shape[0] * a.element_size()) % 16 == 0
            and all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (a, weight)))


def tma_linear(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k_per_split: int,
               ranges: bool) -> torch.Tensor:
    """a [M, K] @ weight [N, K].T + bias -> [M, N] in a's dtype, as ``invariant_linear`` computes it
    for a weight whose K order is (``k_per_split``, ``ranges``: whether K is cut). 16-bit operands,
    16-byte aligned, unit stride along K (``takes``' conditions but the row count)."""
    m, k = a.shape
    n = weight.shape[0]
    block_m, block_n, block_k, warps, stages = launch_tiles(ranges, a.element_size(),
                                                            launch_limits.device_limits(a.device))
    if ranges and k_per_split % block_k:
        raise ValueError(f"K ranges of {k_per_split} are not whole {block_k}-deep steps")
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    programs = min(num_compute_units(a.device), triton.cdiv(m, block_m) * triton.cdiv(n, block_n))
    _tma_linear_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [block_m, block_k]), TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        weight if bias is None else bias, TensorDescriptor.from_tensor(out, [block_m, block_n]),
        m, n, k, programs, K_PER_SPLIT=k_per_split, RANGES=ranges, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=8, HAS_BIAS=bias is not None, **dot_args(_tma_linear_kernel, a.dtype),
        num_warps=warps, num_stages=stages,
    )
    return out
