"""FP8 routed experts (W8A8, 128 x 128 weight blocks, 1 x 128 activation groups) at prefill sizes
on Hopper: ``triton_fp8_moe``'s two GEMMs over expert-sorted rows with TMA loads and a persistent
grid, as ``triton_grouped_gemm`` runs the bf16 ones.

x's rows are quantized (as ``quantize_activation`` quantizes them) straight into the plan's order
(``moe_grouped_mm.plan_rows``, each expert's rows padded to the row tile, so no tile holds two
experts), e4m3 values and group scales, in one pass. Per K group the e4m3 dot is scaled by (row
scale x block scale) in float32 and added, the epilogue rounds SiLU(gate) * up (or relu^2) as the
bf16 path does and quantizes the activation tile (one group a row) to e4m3 + its scale, and the down
GEMM writes each row in x's dtype: ``triton_fp8_moe``'s arithmetic in its order, so the same bits
where the tensor cores give each K group's dot the same bits. Against the fused kernels at
Qwen3-30B-A3B's 8,192-token mixed step (H100) its GEMMs are even; what it gains (~4 % of the step)
is ``plan_rows``' placement of the pairs, where the fused path's alignment runs one program per
expert over every id (docs/PERFORMANCE.md, FP8)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_async.kernels import cuda_device, launch_limits
from megatron_async.kernels.moe_grouped_mm import PendingCombine, combine_slots, plan_rows, triton_experts_allowed
from megatron_async.kernels.triton_act import relu_sq, silu_mul
from megatron_async.kernels.triton_fp8_common import quantize_groups
from megatron_async.kernels.triton_grouped_gemm import expert_grid, expert_tile
from megatron_async.kernels.triton_paged_common import TL_DTYPES, num_compute_units

class GroupedTiles(NamedTuple):
    block_m: int
    num_warps: int
    num_stages: int
    per_sm: int
    """Programs an SM."""
    maxnreg: int = 0
    """Registers a thread at most (0: the compiler's choice)."""


TILES = {"gate_up": GroupedTiles(64, 8, 2, 2, 128), "down": GroupedTiles(64, 8, 3, 2, 128)}
"""(BLOCK_M, warps, stages, programs an SM, register cap) of each GEMM; tiles are BLOCK_M rows x 128
columns x one 128-deep K group. Each K group's scaling waits for its dot, so two programs an SM keep
the tensor cores busy while the other scales (as ``triton_fp8_moe``'s tiles do), and both must fit
one SM together (``launch_limits.resident_programs``): gate_up's two accumulators took 185
registers a thread uncapped and its three stages 131 KB, so one program ran an SM; capped at 128
registers on two stages (90 KB) two do (down's 96 registers and 90 KB already did; its cap only
states it).
Qwen3-30B-A3B's layer on an H200 (``fp8 kernels --tokens 4096 8192``, graph us, same bits): 608 /
1,108 against 691 / 1,214 for gate_up's three uncapped stages; swept at 8,192 tokens: capped on
three stages 1,201, down on two stages 1,211, down on 4 warps three or four an SM 1,087-1,434,
128-row tiles 1,243-1,268."""
ROW_TILE = max(bm for bm, *_ in TILES.values())
"""The plan pads each expert's rows to a multiple of this (of every BLOCK_M in ``TILES``), so no
row tile holds two experts; no more, since every padding row is quantized and multiplied."""
GROUP_M = 4
QUANTIZE_ROWS = 32  # rows a program of the quantize-and-gather pass (as ``quantize_activation``'s)


@triton.jit
def _quantize_rows_kernel(x_ptr, tok_ptr, ends_ptr, q_ptr, s_ptr, stride_x, E, K, ROWS: tl.constexpr):
    """Rows r < the last row end: q[r], s[r] = x[tok[r]] quantized per 1 x 128 group (program:
    ROWS rows x one group), as ``quantize_activation`` quantizes x's rows: the plan's e4m3 rows in
    one pass instead of quantizing x and gathering its rows."""
    g = tl.program_id(1)
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    k = g * 128 + tl.arange(0, 128)
    live = r < tl.load(ends_ptr + E - 1)
    mask = live[:, None] & (k < K)[None, :]
    tok = tl.load(tok_ptr + r, mask=live, other=0).to(tl.int64)
    q, sc = quantize_groups(tl.load(x_ptr + tok[:, None] * stride_x + k[None, :], mask=mask, other=0.0).to(tl.float32),
                            False)
    tl.store(q_ptr + r[:, None] * K + k[None, :], q, mask=mask)
    tl.store(s_ptr + r * tl.cdiv(K, 128) + g, sc, mask=live)


@triton.jit(do_not_specialize=["num_programs"])
def _gate_up_kernel(a_desc, as_ptr, w_desc, ws_ptr, stride_wse, stride_wsn, stride_wsg, h_desc, hs_ptr, ends_ptr,
                    E, I, K, num_programs, OUT_DTYPE: tl.constexpr,
                    BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, E_BLOCK: tl.constexpr, GATED: tl.constexpr):
    BLOCK_N: tl.constexpr = 128  # one activation group a row: the epilogue quantizes the tile whole
    ends, num_m, num_n = expert_grid(ends_ptr, E, I, BLOCK_M, BLOCK_N, E_BLOCK)
    groups = tl.cdiv(K, 128)
    rows = tl.arange(0, BLOCK_M)
    for tile in range(tl.program_id(0), num_m * num_n, num_programs):
        m0, pid_n, expert = expert_tile(ends, tile, num_m, num_n, GROUP_M, BLOCK_M)
        w_row = expert * I * (1 + GATED) + pid_n * BLOCK_N
        s_base = ws_ptr + expert.to(tl.int64) * stride_wse
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, groups):
            a = a_desc.load([m0, g * 128])
            a_s = tl.load(as_ptr + (m0 + rows).to(tl.int64) * groups + g)
            sg = tl.load(s_base + pid_n * stride_wsn + g * stride_wsg)
            acc_g += tl.dot(a, w_desc.load([w_row, g * 128]).T) * (a_s * sg)[:, None]
            if GATED:
                su = tl.load(s_base + (I // 128 + pid_n) * stride_wsn + g * stride_wsg)
                acc_u += tl.dot(a, w_desc.load([w_row + I, g * 128]).T) * (a_s * su)[:, None]
        # the projections in the activation dtype, the activation as the bf16 path rounds it
        if GATED:
            act = silu_mul(acc_g.to(OUT_DTYPE).to(tl.float32), acc_u.to(OUT_DTYPE).to(tl.float32), OUT_DTYPE)
        else:
            act = relu_sq(acc_g.to(OUT_DTYPE).to(tl.float32), OUT_DTYPE)
        h_q, h_s = quantize_groups(act.to(tl.float32), False)
        h_desc.store([m0, pid_n * BLOCK_N], h_q)
        tl.store(hs_ptr + (m0 + rows).to(tl.int64) * num_n + pid_n, h_s)


@triton.jit(do_not_specialize=["num_programs"])
def _down_kernel(a_desc, hs_ptr, w_desc, ws_ptr, stride_wse, stride_wsn, stride_wsg, out_desc, ends_ptr, E, H, I,
                 num_programs, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, E_BLOCK: tl.constexpr):
    BLOCK_N: tl.constexpr = 128  # one weight scale block a column tile
    ends, num_m, num_n = expert_grid(ends_ptr, E, H, BLOCK_M, BLOCK_N, E_BLOCK)
    groups = tl.cdiv(I, 128)
    rows = tl.arange(0, BLOCK_M)
    for tile in range(tl.program_id(0), num_m * num_n, num_programs):
        m0, pid_n, expert = expert_tile(ends, tile, num_m, num_n, GROUP_M, BLOCK_M)
        s_base = ws_ptr + expert.to(tl.int64) * stride_wse + pid_n * stride_wsn
        w_row = expert * H + pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, groups):
            a_s = tl.load(hs_ptr + (m0 + rows).to(tl.int64) * groups + g)
            s = tl.load(s_base + g * stride_wsg)
            acc += tl.dot(a_desc.load([m0, g * 128]), w_desc.load([w_row, g * 128]).T) * (a_s * s)[:, None]
        out_desc.store([m0, pid_n * BLOCK_N], acc.to(out_desc.dtype))


def footprint(gemm: str, gated: bool, out_bytes: int):
    """Each K group: a [BLOCK_M, 128] e4m3 activation tile and one (down, relu^2's gate_up) or two
    (gated gate_up) [128, 128] e4m3 weight tiles; ``out_bytes``: the stored tile's element size."""
    def of(t: GroupedTiles) -> launch_limits.Footprint:
        return launch_limits.gemm_footprint(t.block_m, 128, 128, t.num_stages, t.num_warps, 1, 1,
                                            2 if gemm == "gate_up" and gated else 1, out_bytes)
    return of


def launch_tiles(gemm: str, gated: bool, out_bytes: int, limits: launch_limits.DeviceLimits) -> GroupedTiles:
    """``TILES[gemm]`` on the most stages ``limits`` hold (BLOCK_M is the plan's row tile: fixed)."""
    return launch_limits.fit(TILES[gemm], footprint(gemm, gated, out_bytes), limits)


def takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
          scale_block_n: tuple[int, int]) -> bool:
    """CUDA on Hopper, 128-row weight scale blocks in both GEMMs, K, I and H multiples of 128,
    contiguous weights, and a batch the Triton grouped experts take
    (``moe_grouped_mm.triton_experts_allowed``: its size rule, as the bf16 path's)."""
    E, _, K = w13.shape
    H, I = w2.shape[1], w2.shape[2]
    return (x.is_cuda and cuda_device.capability(x.device)[0] == 9 and scale_block_n == (128, 128)
            and K % 128 == 0 and I % 128 == 0 and H % 128 == 0 and w13.is_contiguous() and w2.is_contiguous()
            and triton_experts_allowed(E, topk_ids))


def fused_experts_fp8_grouped(x: torch.Tensor, w13: torch.Tensor, ws13: torch.Tensor, w2: torch.Tensor,
                              ws2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gated: bool,
                              defer_combine: bool = False) -> torch.Tensor | PendingCombine:
    """``triton_fp8_moe.fused_experts_fp8`` for operands ``takes`` accepts (the caller checks)."""
    M, K = x.shape
    E = w13.shape[0]
    H, I = w2.shape[1], w2.shape[2]
    row_of_pair, token_of_row, offs = plan_rows(topk_ids, E, ROW_TILE)
    P = token_of_row.shape[0]
    a = torch.empty((P, K), dtype=torch.float8_e4m3fn, device=x.device)
    a_s = torch.empty((P, K // 128), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(triton.cdiv(P, QUANTIZE_ROWS), K // 128)](x, token_of_row, offs, a, a_s, x.stride(0), E, K,
                                                                     ROWS=QUANTIZE_ROWS, num_warps=4)
    h = torch.empty((P, I), dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty((P, I // 128), dtype=torch.float32, device=x.device)
    sms = num_compute_units(x.device)
    e_block = triton.next_power_of_2(E)
    limits = launch_limits.device_limits(x.device)
    bm, warps, stages, per_sm, maxnreg = launch_tiles("gate_up", gated, 1, limits)
    programs = min(sms * per_sm, triton.cdiv(P, bm) * (I // 128))
    _gate_up_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, 128]), a_s,
        TensorDescriptor.from_tensor(w13.view(-1, K), [128, 128]), ws13, ws13.stride(0), ws13.stride(1),
        ws13.stride(2), TensorDescriptor.from_tensor(h, [bm, 128]), hs, offs, E, I, K, programs,
        OUT_DTYPE=TL_DTYPES[x.dtype], BLOCK_M=bm, GROUP_M=GROUP_M, E_BLOCK=e_block, GATED=gated, num_warps=warps,
        num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    y = torch.empty((P, H), dtype=x.dtype, device=x.device)
    bm, warps, stages, per_sm, maxnreg = launch_tiles("down", gated, x.element_size(), limits)
    programs = min(sms * per_sm, triton.cdiv(P, bm) * (H // 128))
    _down_kernel[(programs,)](
        TensorDescriptor.from_tensor(h, [bm, 128]), hs, TensorDescriptor.from_tensor(w2.view(-1, I), [128, 128]),
        ws2, ws2.stride(0), ws2.stride(1), ws2.stride(2), TensorDescriptor.from_tensor(y, [bm, 128]), offs, E, H,
        I, programs, BLOCK_M=bm, GROUP_M=GROUP_M, E_BLOCK=e_block, num_warps=warps, num_stages=stages,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    del a, a_s, h, hs
    if defer_combine:
        return PendingCombine(y, row_of_pair, topk_ids, topk_weights, E, x.dtype)
    return combine_slots(y, row_of_pair, topk_ids, topk_weights, E, x.dtype)

