"""Routed experts' two GEMMs over expert-sorted rows in Triton, the activation in the first one's
epilogue: for prefill-size batches on Hopper, in place of torch's grouped GEMM (CUTLASS) + the
activation kernel + its grouped GEMM again (``moe_grouped_mm``).

The plan (``moe_grouped_mm.plan_rows``) pads each expert's rows to a multiple of the row tile, so
no row tile holds two experts: a program finds its tile's expert among the experts' cumulative
row ends and loads that expert's weight rows through one 2-D TMA descriptor over all experts
([E x N, K]). Persistent, tiles in grouped order (the row tiles of one expert share its weight
tiles while they are in L2), as ``triton_swiglu_matmul``; the tile count comes from the last
row end on the device, so CUDA graphs replay it with any routing. Row tiles past the last end are
never computed; padding rows inside an expert's last tile are computed and never read.

Rounds like the grouped GEMM path: each projection rounded to the activation dtype, then the
activation as ``triton_act`` rounds it (torch's ops). Only the projections' accumulation order
differs from CUTLASS's. One Qwen3-30B-A3B layer's routed experts on an H100 at 8,192 tokens:
1.41 against 1.50 ms with CUTLASS's GEMMs and the activation kernel (docs/PERFORMANCE.md, MoE)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_async.kernels import cuda_device, launch_limits
from megatron_async.kernels.triton_act import relu_sq, silu_mul
from megatron_async.kernels.triton_gemm_common import grouped_tile
from megatron_async.kernels.triton_paged_common import dot_args, num_compute_units

class GroupedGemmTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


TILES = {True: GroupedGemmTiles(128, 128, 64, 8, 4), False: GroupedGemmTiles(128, 256, 64, 8, 3)}
"""(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the gated first GEMM (gate and up accumulators) and
a plain one (relu^2's first, every down), the fastest of a sweep at the 30B-A3B layer's shapes
(H100, 4,096 and 8,192 tokens: gate_up 471-475 / 749-772 us on 4 stages against 500-503 / 780-785
on 3; down 295-298 / 442-477 in 128 x 256 tiles against 309-313 / 506-511 in 128 x 128 on 4
stages; 64-row tiles slower at 8,192: 867 / 466). Two programs an SM, as the FP8 experts take,
only cost here (8,192 tokens: gate_up 770 us on 3 stages, 64-row tiles 952-1,066; down 457): the
bf16 dots need no scaling between K steps, so one program keeps its pipeline full."""
GROUP_M = 4
"""Row tiles walked together over a column of weight tiles: ~4 make one expert's rows at 512 pairs
an expert (2-3 % faster than 8 in the sweep)."""
INTERPRETER_TILES = {True: GroupedGemmTiles(16, 16, 16, 1, 1), False: GroupedGemmTiles(16, 16, 16, 1, 1)}
"""Tiles tiny test shapes still cross (Triton's CPU interpreter)."""


def footprint(gated: bool, elem_bytes: int):
    """A [BLOCK_M, BLOCK_K] activation tile and one (two: gate and up) [BLOCK_N, BLOCK_K] weight tiles a
    step, all of ``elem_bytes``; the [BLOCK_M, BLOCK_N] output tile stored through shared memory."""
    def of(t: GroupedGemmTiles) -> launch_limits.Footprint:
        return launch_limits.gemm_footprint(t.block_m, t.block_n, t.block_k, t.num_stages, t.num_warps,
                                            elem_bytes, elem_bytes, 2 if gated else 1, elem_bytes)
    return of


def launch_tiles(gated: bool, elem_bytes: int, limits: launch_limits.DeviceLimits) -> GroupedGemmTiles:
    """``TILES[gated]`` where ``limits`` hold it, else the most stages that fit, then the other entry of
    ``TILES`` if smaller (both keep the plan's BLOCK_M)."""
    return launch_limits.fit(TILES[gated], footprint(gated, elem_bytes), limits, tuple(TILES.values()))


def row_tile(device: torch.device) -> int:
    """Rows a tile holds: the plan pads each expert's rows to a multiple of this."""
    return (TILES if device.type == "cuda" else INTERPRETER_TILES)[True][0]


@triton.jit
def expert_grid(ends_ptr, E, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, E_BLOCK: tl.constexpr):
    """(the experts' cumulative row ends, row tiles up to the last end, column tiles): the persistent
    loop's bounds, read on the device."""
    ev = tl.arange(0, E_BLOCK)
    ends = tl.load(ends_ptr + ev, mask=ev < E, other=2**30)
    return ends, tl.load(ends_ptr + E - 1) // BLOCK_M, tl.cdiv(N, BLOCK_N)


@triton.jit
def expert_tile(ends, tile, num_m, num_n, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr):
    """(first row, column tile, expert) of the ``tile``-th tile in grouped order: the expert is
    the number of row ends at or before its first row."""
    pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
    m0 = pid_m * BLOCK_M
    return m0, pid_n, tl.sum((ends <= m0).to(tl.int32), axis=0)


@triton.jit(do_not_specialize=["num_programs"])
def _grouped_kernel(a_desc, w_desc, out_desc, ends_ptr, E, N, K, num_programs, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, E_BLOCK: tl.constexpr,
                    GATED: tl.constexpr, ACT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[rows of expert e] = act(a[rows] @ W_e.T), W_e = the weight rows e * (2N if GATED else N)
    on: silu(gate) * up of [gate | up] (GATED), relu(h)^2 (ACT, not GATED) or the projection."""
    ends, num_m, num_n = expert_grid(ends_ptr, E, N, BLOCK_M, BLOCK_N, E_BLOCK)
    dt = out_desc.dtype
    for tile in range(tl.program_id(0), num_m * num_n, num_programs):
        m0, pid_n, expert = expert_tile(ends, tile, num_m, num_n, GROUP_M, BLOCK_M)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # Columns past N (a last column tile) read the next weight rows: their outputs are clipped by the store
        w_row = expert * N * (1 + GATED) + pid_n * BLOCK_N
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([m0, k0]).to(DOT_DTYPE)
            if GATED:
                wg = w_desc.load([w_row, k0]).to(DOT_DTYPE)
                acc_gate = tl.dot(a, wg.T, acc_gate, input_precision=DOT_PRECISION)
                wu = w_desc.load([w_row + N, k0]).to(DOT_DTYPE)
            else:
                wu = w_desc.load([w_row, k0]).to(DOT_DTYPE)
            acc_up = tl.dot(a, wu.T, acc_up, input_precision=DOT_PRECISION)
        if GATED:
            out = silu_mul(acc_gate.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32), dt)
        elif ACT:
            out = relu_sq(acc_up.to(dt).to(tl.float32), dt)
        else:
            out = acc_up.to(dt)
        out_desc.store([m0, pid_n * BLOCK_N], out)


def takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``experts`` takes these operands: Hopper (TMA; Blackwell keeps CUTLASS, not
    measured here) or the CPU interpreter, contiguous weights and 16-byte rows. The dispatch
    (``moe_grouped_mm.use_triton_experts``) adds the batch size."""
    if x.is_cuda and cuda_device.capability(x.device)[0] != 9:
        return False
    rows_ok = all(t.shape[-1] * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in (x, w13, w2))
    return x.dim() == 2 and x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous() and rows_ok


def _launch(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, n: int, gated: bool, act: bool) -> torch.Tensor:
    E, _, K = w.shape
    if a.is_cuda:
        bm, bn, bk, warps, stages = launch_tiles(gated, a.element_size(), launch_limits.device_limits(a.device))
    else:
        bm, bn, bk, warps, stages = INTERPRETER_TILES[gated]
    out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    programs = min(num_compute_units(a.device), triton.cdiv(a.shape[0], bm) * triton.cdiv(n, bn))
    _grouped_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(w.view(-1, K), [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), ends, E, n, K, programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=GROUP_M, E_BLOCK=triton.next_power_of_2(E), GATED=gated, ACT=act,
        **dot_args(_grouped_kernel, a.dtype), num_warps=warps, num_stages=stages)
    return out


def experts(a: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor, gated: bool) -> torch.Tensor:
    """a [P, K]: rows sorted by expert, each expert's rows ending at ``ends`` [E] (int32,
    cumulative, multiples of ``row_tile``); w13 [E, 2I or I, K], w2 [E, H, I] -> [P, H], the rows
    past ``ends[-1]`` unwritten. Operands must pass ``takes``."""
    inter = w2.shape[2]
    h = _launch(a, w13, ends, inter, gated, not gated)
    return _launch(h, w2, ends, w2.shape[1], False, False)
