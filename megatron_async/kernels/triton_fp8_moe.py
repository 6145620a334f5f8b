"""The fused Triton MoE (``triton_fused_moe``) with FP8 experts (W8A8, block-scaled, see fp8_quant).

Experts' weights are e4m3 with 128 x 128 block scales: w13 [E, N, K] (N = 2I rows [gate | up] or I)
with ws13 [E, ceil(N / SB), ceil(K / 128)], w2 [E, H, I] with ws2 [E, ceil(H / SB), ceil(I / 128)],
SB (``scale_block_n``, one per GEMM) 128, or 1 for one scale row per weight row (I % 128 != 0, or a TP shard of I
that does not start on a block boundary). The router stays bf16 (it is a ReplicatedLinear outside
this file); alignment (``align_pairs``) and the slot sum are the bf16 path's kernels.

1. gate_up: per block of pairs, the x rows of its tokens quantized per 1 x 128 group (in registers
   for a few tokens, where a token routed to k experts is quantized k times to the same bits;
   above ``SMALL_M`` tokens once per token by ``quantize_activation``), e4m3 dots per group with
   float32 promotion, SiLU(gate) * up rounded as the bf16 path rounds it, then the EPILOGUE
   quantizes the activation tile (BLOCK_N = 128 = one group per row) and writes e4m3 h + one scale
   per (pair, group): the down GEMM's input is never written in bf16 nor re-read to be quantized.
2. down: h (pre-quantized) @ w2 per group, float32, each pair's row rounded to x's dtype as the
   FP8 linear rounds its output (the bf16 grouped GEMM's rows: half the bytes of float32 rows,
   ~0.5 GB less traffic a layer at 8,192 tokens of Qwen3-30B-A3B).
3. the slot sum of the grouped GEMM (``moe_grouped_mm.combine_slots``: routing weights times the
   rows, float32, in slot order), or left to the next block's norm (``defer_combine``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_async.kernels import launch_limits, triton_fp8_grouped
from megatron_async.kernels.triton_fp8_common import emulate, quantize_groups
from megatron_async.kernels.triton_fp8_gemm import SMALL_M, quantize_activation
from megatron_async.kernels.moe_grouped_mm import PendingCombine, combine_slots
from megatron_async.kernels.triton_fused_moe import align_pairs


@dataclass(frozen=True)
class Fp8MoeTiles:
    """Launch settings of the two GEMMs for one alignment (``rows_per_block``: pairs per aligned block,
    each GEMM's rows a program). BLOCK_K is 128 in both (one scale group per dot); gate_up's
    BLOCK_N is 128 (one activation group, quantized whole in its epilogue) for each of gate and
    up, so a gate_up program holds two [BLOCK_M, 128] float32 accumulators."""
    gate_up_warps: int
    gate_up_stages: int
    down_block_n: int
    down_warps: int
    down_stages: int


FP8_MOE_TILES = {
    16: Fp8MoeTiles(gate_up_warps=4, gate_up_stages=3, down_block_n=64, down_warps=4, down_stages=3),
    32: Fp8MoeTiles(gate_up_warps=4, gate_up_stages=3, down_block_n=64, down_warps=4, down_stages=3),
    64: Fp8MoeTiles(gate_up_warps=4, gate_up_stages=2, down_block_n=128, down_warps=8, down_stages=4),
}
"""Per alignment (``rows_per_block``). 64-row blocks (above 16 pairs per expert: 257+ tokens of
Qwen3-30B-A3B): two programs an SM in both GEMMs (gate_up on 4 warps, 2 stages, 80 KB; down in
64 x 128 tiles on 8 warps, 4 stages, 96 KB), independent warpgroups whose scale epilogues overlap
the other's tensor-core work. Measured on an H100 beside one gate_up program an SM (8 warps, 4
stages) with down on 4 warps, and beside 128-row blocks above 256 pairs per expert (down in 128 x
128 tiles, gate_up in 64-row slices): the fastest at 2,048 and 8,192 tokens (numbers in
docs/PERFORMANCE.md). 16 rows (decode, up to 16 pairs an expert): as fast as 64 at 16 and faster
below; swept at 64 / 128 / 256 tokens of Qwen3-30B-A3B (gate_up on 2-8 warps x 2-5 stages, down
in 32-128 columns x 2-8 warps x 2-4 stages, one GEMM varied at a time): no setting 0.2 % faster.
32 rows (only when asked for): slower than 64 from 24 pairs an expert on, by 10-23 % at 32-128."""


def gate_up_footprint(rows: int, a_bytes: int, gated: bool):
    """gate_up's tiles: [rows, 128] activations (e4m3 when prequantized, else their type), one or
    two [128, 128] e4m3 weight tiles a K group."""
    def footprint(t: Fp8MoeTiles) -> launch_limits.Footprint:
        return launch_limits.gemm_footprint(rows, 128, 128, t.gate_up_stages, t.gate_up_warps, a_bytes, 1,
                                            2 if gated else 1)
    return footprint


def down_footprint(rows: int, out_bytes: int):
    """down's tiles: [rows, 128] e4m3 activations, a [down_block_n, 128] e4m3 weight tile a K group."""
    def footprint(t: Fp8MoeTiles) -> launch_limits.Footprint:
        return launch_limits.gemm_footprint(rows, t.down_block_n, 128, t.down_stages, t.down_warps, 1, 1,
                                            out_bytes=out_bytes)
    return footprint


def fp8_moe_tiles(rows: int, a_bytes: int, out_bytes: int, gated: bool,
                  limits: launch_limits.DeviceLimits) -> Fp8MoeTiles:
    """``FP8_MOE_TILES[rows]`` with each GEMM's setting fitted to ``limits`` (``launch_limits.fit``)."""
    table = tuple(FP8_MOE_TILES.values())
    up = launch_limits.fit(FP8_MOE_TILES[rows], gate_up_footprint(rows, a_bytes, gated), limits, table,
                           "gate_up_stages")
    down = launch_limits.fit(FP8_MOE_TILES[rows], down_footprint(rows, out_bytes), limits, table, "down_stages")
    return Fp8MoeTiles(up.gate_up_warps, up.gate_up_stages, down.down_block_n, down.down_warps, down.down_stages)


def rows_per_block(num_pairs: int, num_experts: int) -> int:
    """Each expert's pairs aligned to 16 rows up to 16 pairs an expert, else to 64. The bf16 path's
    middle size (32 rows, ``triton_fused_moe._block_m``) measured slower here than 64 at every
    size above 16 pairs an expert (Qwen3-30B-A3B's layer, H100: 378.6 against 307.7 us at 1,024
    tokens, 286.4 against 258.7 at 512)."""
    return 16 if num_pairs <= 16 * max(1, min(num_experts, num_pairs)) else 64


@triton.jit
def _weight_scales(s_col, n0, offs_n, mask_n, stride_wsn, SCALE_BLOCK_N: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight scales of a tile's columns n0 + offs_n in one K group (``s_col``: that group's
    column of the scales): one scalar where the columns share a scale row (the 128-row grid), not
    BLOCK_N loads of it and a [BLOCK_M, BLOCK_N] product in registers (which the two-accumulator
    gate_up ran out of); else the [BLOCK_N] vector."""
    if SCALE_BLOCK_N % BLOCK_N == 0:
        return tl.load(s_col + (n0 // SCALE_BLOCK_N) * stride_wsn)
    else:
        return tl.load(s_col + (offs_n // SCALE_BLOCK_N) * stride_wsn, mask=mask_n, other=0.0)


@triton.jit
def _scales_of_group(s_next, s_base, g, groups, n0, offs_n, mask_n, stride_wsn, stride_wsg,
                     SCALE_BLOCK_N: tl.constexpr, BLOCK_N: tl.constexpr):
    """(K group g's weight scales, what the loop carries to g + 1). A scalar comes from the
    previous group's call and the next group's is loaded now (the last group reloads its own):
    its latency hides behind this group's dots, where a load after a dot's wait stalled the
    multiply every group. A vector is loaded for its own group (held across the dots, it spilled)."""
    if SCALE_BLOCK_N % BLOCK_N == 0:
        ahead = s_base + tl.minimum(g + 1, groups - 1) * stride_wsg
        return s_next, _weight_scales(ahead, n0, offs_n, mask_n, stride_wsn, SCALE_BLOCK_N, BLOCK_N)
    else:
        return _weight_scales(s_base + g * stride_wsg, n0, offs_n, mask_n, stride_wsn, SCALE_BLOCK_N, BLOCK_N), s_next


@triton.jit
def _times_scales(part, a_s, s, SCALE_BLOCK_N: tl.constexpr, BLOCK_N: tl.constexpr):
    """A K group's dot [BLOCK_M, BLOCK_N] times (its row's activation scale x its column's weight
    scale ``s``, from ``_weight_scales``): the same float32 products either way."""
    if SCALE_BLOCK_N % BLOCK_N == 0:
        return part * (a_s * s)[:, None]
    else:
        return part * (a_s[:, None] * s[None, :])


@triton.jit
def _gate_up_fp8_kernel(x_ptr, xq_ptr, xs_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, pairs_ptr, block_expert_ptr, num_pairs,
                        stride_xm, stride_xqm, stride_xsm, stride_xsg, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsg,
                        stride_hsm, K: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, E: tl.constexpr,
                        GATED: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                        PREQUANT: tl.constexpr, EMULATE: tl.constexpr):
    BLOCK_N: tl.constexpr = 128  # one activation group per output tile: the epilogue quantizes it whole
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= E:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    mask_m = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = ws_ptr + expert.to(tl.int64) * stride_wse
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    groups = tl.cdiv(K, 128)
    sg_next = _weight_scales(s_base, pid_n * BLOCK_N, offs_n, mask_n, stride_wsn, SCALE_BLOCK_N, BLOCK_N)
    if GATED:
        su_next = _weight_scales(s_base, I + pid_n * BLOCK_N, I + offs_n, mask_n, stride_wsn, SCALE_BLOCK_N, BLOCK_N)
    if PREQUANT:  # activation scales a group ahead too
        as_next = tl.load(xs_ptr + token * stride_xsm, mask=mask_m, other=0.0)
    for g in range(0, groups):
        sg, sg_next = _scales_of_group(sg_next, s_base, g, groups, pid_n * BLOCK_N, offs_n, mask_n, stride_wsn,
                                       stride_wsg, SCALE_BLOCK_N, BLOCK_N)
        if GATED:
            su, su_next = _scales_of_group(su_next, s_base, g, groups, I + pid_n * BLOCK_N, I + offs_n, mask_n,
                                           stride_wsn, stride_wsg, SCALE_BLOCK_N, BLOCK_N)
        offs_k = g * 128 + tl.arange(0, 128)
        mask_k = offs_k < K
        a_mask = mask_m[:, None] & mask_k[None, :]
        if PREQUANT:  # x quantized once per token (e4m3 + group scales), not per pair and column tile
            a_q = tl.load(xq_ptr + token[:, None] * stride_xqm + offs_k[None, :], mask=a_mask, other=0.0)
            a_s = as_next
            as_next = tl.load(xs_ptr + token * stride_xsm + tl.minimum(g + 1, groups - 1) * stride_xsg, mask=mask_m,
                              other=0.0)
        else:
            a_q, a_s = quantize_groups(tl.load(x_ptr + token[:, None] * stride_xm + offs_k[None, :], mask=a_mask,
                                               other=0.0).to(tl.float32), EMULATE)
        if EMULATE:
            a_q = a_q.to(tl.float32)
        wmask = mask_k[:, None] & mask_n[None, :]
        wg = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
        if EMULATE:
            wg = wg.to(tl.float32)
        acc_g += _times_scales(tl.dot(a_q, wg), a_s, sg, SCALE_BLOCK_N, BLOCK_N)
        if GATED:
            wu = tl.load(w_base + (I + offs_n)[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
            if EMULATE:
                wu = wu.to(tl.float32)
            acc_u += _times_scales(tl.dot(a_q, wu), a_s, su, SCALE_BLOCK_N, BLOCK_N)
    dt = x_ptr.dtype.element_ty
    if GATED:  # rounds like F.silu(gate) * up on projections in the activation dtype
        gr = acc_g.to(dt).to(tl.float32)
        act = (gr / (1.0 + tl.exp(-gr))).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)
    else:
        r = tl.maximum(acc_g.to(dt).to(tl.float32), 0.0)
        act = r * r
    # the activation as the bf16 path would store it, then quantized like any GEMM input
    act = tl.where(mask_n[None, :], act.to(dt).to(tl.float32), 0.0)
    h_q, h_s = quantize_groups(act, EMULATE)
    row = pair.to(tl.int64)
    tl.store(h_ptr + row[:, None] * I + offs_n[None, :], h_q, mask=mask_m[:, None] & mask_n[None, :])
    tl.store(hs_ptr + row * stride_hsm + pid_n, h_s, mask=mask_m)


@triton.jit
def _down_fp8_kernel(h_ptr, hs_ptr, w_ptr, ws_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs,
                     stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsg,
                     I: tl.constexpr, H: tl.constexpr, E: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= E:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    mask_m = pair < num_pairs
    row = pair.to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = ws_ptr + expert.to(tl.int64) * stride_wse
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    groups = tl.cdiv(I, 128)
    s_next = _weight_scales(s_base, pid_n * BLOCK_N, offs_n, mask_n, stride_wsn, SCALE_BLOCK_N, BLOCK_N)
    as_next = tl.load(hs_ptr + row * stride_hsm, mask=mask_m, other=0.0)
    for g in range(0, groups):  # scales a K group ahead, as in gate_up
        s, s_next = _scales_of_group(s_next, s_base, g, groups, pid_n * BLOCK_N, offs_n, mask_n, stride_wsn,
                                     stride_wsg, SCALE_BLOCK_N, BLOCK_N)
        a_s = as_next
        as_next = tl.load(hs_ptr + row * stride_hsm + tl.minimum(g + 1, groups - 1), mask=mask_m, other=0.0)
        offs_k = g * 128 + tl.arange(0, 128)
        mask_k = offs_k < I
        a_q = tl.load(h_ptr + row[:, None] * I + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0)
        if EMULATE:
            part = tl.dot(a_q.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a_q, w)
        acc += _times_scales(part, a_s, s, SCALE_BLOCK_N, BLOCK_N)
    tl.store(out_ptr + row[:, None] * H + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def fused_experts_fp8(x: torch.Tensor, w13: torch.Tensor, ws13: torch.Tensor, w2: torch.Tensor, ws2: torch.Tensor,
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor, gated: bool,
                      scale_block_n: tuple[int, int] = (128, 128), prequantize: bool | None = None,
                      tiles: Fp8MoeTiles | None = None, block_rows: int | None = None,
                      defer_combine: bool = False, triton_grouped_gemm: bool = True) -> torch.Tensor | PendingCombine:
    """``kernels.moe_experts.fused_experts`` with e4m3 expert weights and their block scales:
    ws13 [E, ceil(N / sb13), ceil(K / 128)], ws2 [E, ceil(H / sb2), ceil(I / 128)] with
    ``scale_block_n`` = (sb13, sb2), each 128 or 1. ``prequantize`` (None: above ``SMALL_M``
    tokens, as the dense FP8 linear) quantizes x once per token before the gate_up GEMM instead
    of in it for every (pair, column tile): the same bits. ``tiles`` / ``block_rows`` override
    ``FP8_MOE_TILES`` / ``rows_per_block`` (each expert's pairs aligned to ``block_rows``: both GEMMs'
    rows a program). ``defer_combine``: the slot sum as a
    ``PendingCombine`` for the next block's norm. Prefill-size batches on Hopper (without
    ``tiles`` / ``block_rows``) run ``triton_fp8_grouped`` instead (``triton_grouped_gemm`` False: not)."""
    sb13, sb2 = scale_block_n
    M, K = x.shape
    E, N, _ = w13.shape
    H, I = w2.shape[1], w2.shape[2]
    top_k = topk_ids.shape[1]
    if N != (2 * I if gated else I) or w13.shape[2] != K or w2.shape[0] != E:
        raise ValueError(f"fused_experts_fp8: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    if gated and sb13 != 1 and I % sb13:
        raise ValueError("fused_experts_fp8: [gate | up] on one 128-row grid needs I % 128 == 0 (else sb13 = 1)")
    num_pairs = M * top_k
    if num_pairs == 0:
        return torch.zeros((M, H), dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if (triton_grouped_gemm and tiles is None and block_rows is None
            and triton_fp8_grouped.takes(x, w13, w2, topk_ids, scale_block_n)):
        return triton_fp8_grouped.fused_experts_fp8_grouped(x, w13, ws13, w2, ws2, topk_ids, topk_weights, gated,
                                                            defer_combine)
    cpu = x.device.type == "cpu"
    rows = block_rows or (16 if cpu else rows_per_block(num_pairs, E))
    sorted_pairs, block_expert = align_pairs(topk_ids, E, rows)
    num_blocks = block_expert.shape[0]
    groups_i = triton.cdiv(I, 128)
    h = torch.empty((num_pairs, I), dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty((num_pairs, groups_i), dtype=torch.float32, device=x.device)
    em = emulate(_gate_up_fp8_kernel)
    prequant = M > SMALL_M if prequantize is None else prequantize
    a_bytes = 1 if prequant else x.element_size()
    limits = launch_limits.device_limits(x.device)
    if tiles is not None:
        launch_limits.check(tiles, gate_up_footprint(rows, a_bytes, gated)(tiles), limits)
        t = launch_limits.check(tiles, down_footprint(rows, x.element_size())(tiles), limits)
    else:
        t = Fp8MoeTiles(1, 1, 32, 1, 1) if cpu else fp8_moe_tiles(rows, a_bytes, x.element_size(), gated, limits)
    xq, xs = quantize_activation(x) if prequant else (x, hs)  # (x, hs): unused stand-ins
    _gate_up_fp8_kernel[(num_blocks, groups_i)](
        x, xq, xs, w13, ws13, h, hs, sorted_pairs, block_expert, num_pairs,
        x.stride(0), xq.stride(0), xs.stride(0), xs.stride(1), w13.stride(0), w13.stride(1), ws13.stride(0),
        ws13.stride(1), ws13.stride(2), hs.stride(0),
        K=K, I=I, TOP_K=top_k, E=E, GATED=gated, SCALE_BLOCK_N=sb13, BLOCK_M=rows,
        PREQUANT=prequant, EMULATE=em, num_warps=t.gate_up_warps, num_stages=t.gate_up_stages)
    y = torch.empty((num_pairs, H), dtype=x.dtype, device=x.device)  # pairs of no expert: never written nor read
    bn = t.down_block_n
    _down_fp8_kernel[(num_blocks, triton.cdiv(H, bn))](
        h, hs, w2, ws2, y, sorted_pairs, block_expert, num_pairs,
        hs.stride(0), w2.stride(0), w2.stride(1), ws2.stride(0), ws2.stride(1), ws2.stride(2),
        I=I, H=H, E=E, SCALE_BLOCK_N=sb2, BLOCK_M=rows, BLOCK_N=bn, EMULATE=em,
        num_warps=t.down_warps, num_stages=t.down_stages)
    del h, hs
    if defer_combine:
        return PendingCombine(y, None, topk_ids, topk_weights, E, x.dtype)
    return combine_slots(y, None, topk_ids, topk_weights, E, x.dtype)
