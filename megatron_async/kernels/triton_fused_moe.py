"""Fused MoE for the GPU: the routed experts of a batch as two grouped GEMMs.

1. Alignment: the (token, slot) pairs sorted by expert into blocks of BLOCK_M rows, each block
   one expert's (padded with a sentinel pair). Nothing is synced or sized from device values:
   the buffer has the worst-case padded length ``P = pairs + min(experts, pairs) * (BLOCK_M -
   1)`` computed from the shapes, and blocks past the real end are marked "no expert" and exit
   at once. Small batches: one kernel, one program per expert (``_place_kernel``); from
   ``PLAN_MIN_READS`` the grouped GEMM's plan kernels (``triton_moe_plan.align_pairs``), the same
   layout. ``align_by_expert`` is the same in torch ops (the reference of the tests).
2. ``_gate_up_kernel``: per block, x rows of its pairs @ the expert's [gate | up] (or up) rows,
   float32 accumulation, SiLU(gate) * up (or relu^2) fused in the epilogue -> [pairs, I].
3. ``_down_kernel``: activations @ the expert's down rows, times the routing weight, float32
   -> [pairs, H] (pairs of no expert are not written); ``_sum_slots_kernel`` adds a token's
   routed slots in slot order and rounds once (no atomics: the result does not depend on the
   schedule; no zero-fill, no separate cast).
Graph-safe: every shape and grid comes from tensor shapes."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_async.kernels import launch_limits, triton_moe_plan
from megatron_async.kernels.triton_paged_common import dot_args


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [M, k] (ids outside [0, E) = no expert) -> (sorted_pairs [P] int32: the pair
    index t * k + j of each row, M * k on padding rows; block_expert [P / block_m] int32: the
    expert of each block, E for blocks with nothing to do)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, E, dev = flat.numel(), num_experts, flat.device
    key = torch.where((flat >= 0) & (flat < E), flat, E)  # E: the bucket of pairs with no expert
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank_in_expert = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_key]
    bound = triton.cdiv(n + min(E, n) * (block_m - 1), block_m) * block_m
    routed = sorted_key < E
    dest = torch.where(routed, padded_start[sorted_key.clamp(max=E - 1)] + rank_in_expert, bound)  # bound: dump slot
    sorted_pairs = torch.full((bound + 1,), n, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, bound, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_pairs[:bound], block_expert


@triton.jit
def _place_kernel(ids_ptr, pairs_ptr, block_expert_ptr, n, num_blocks, E: tl.constexpr, BINS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Program e writes expert e's segment of the sorted pairs (in pair order, then padding
    pairs ``n``) and the expert of its blocks; the last program marks the blocks past the end.
    Every program counts all experts' pairs itself (a histogram of the ids; ids outside [0, E)
    land in bin E): redundant, but cheaper than a separate count kernel and its launch."""
    e = tl.program_id(0)
    counts = tl.zeros((BINS,), dtype=tl.int32)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=E)
        counts += tl.histogram(tl.where((ids >= 0) & (ids < E), ids, E), BINS)
    experts = tl.arange(0, BINS)
    counts = tl.where(experts < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < e, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == e, counts, 0), axis=0)
    mine = tl.sum(tl.where(experts == e, padded, 0), axis=0)
    placed = tl.sum(tl.zeros((BLOCK,), dtype=tl.int32), axis=0)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        match = (tl.load(ids_ptr + offs, mask=offs < n, other=-1) == e).to(tl.int32)
        rank = placed + tl.cumsum(match, axis=0) - match
        tl.store(pairs_ptr + start + rank, offs.to(tl.int32), mask=match > 0)
        placed += tl.sum(match, axis=0)
    pad = count + tl.arange(0, BLOCK_M)
    tl.store(pairs_ptr + start + pad, n, mask=pad < mine)
    first_block = start // BLOCK_M
    for b in range(0, mine // BLOCK_M, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        tl.store(block_expert_ptr + first_block + offs, e, mask=offs < mine // BLOCK_M)
    if e == E - 1:
        end_block = (start + mine) // BLOCK_M
        for b in range(end_block, num_blocks, BLOCK):
            offs = b + tl.arange(0, BLOCK)
            tl.store(block_expert_ptr + offs, E, mask=offs < num_blocks)


PLAN_MIN_READS = 1 << 20
"""Pairs x experts from which ``align_pairs`` takes the grouped GEMM's plan kernels (O(pairs)) over
``align_by_expert_triton`` (one program per expert, each reading every id). 128 experts, in a CUDA
graph on an H100 (``kernel-times fused-moe --plan``): 7.9 against 10.8 us at 4,096 pairs, 14.1
against 11.3 at 8,192, 26.4 against 12.3 at 16,384."""


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_by_expert``'s layout for topk_ids [M, k] by whichever kernels are cheaper at its size
    (``PLAN_MIN_READS``); the same rows and blocks either way."""
    if topk_ids.numel() * num_experts >= PLAN_MIN_READS:
        return triton_moe_plan.align_pairs(topk_ids, num_experts, block_m)
    return align_by_expert_triton(topk_ids, num_experts, block_m)


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int,
                           block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_by_expert`` in one kernel; rows of blocks marked E are left unwritten."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    n, E = ids.numel(), num_experts
    bound = triton.cdiv(n + min(E, n) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.empty(bound, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(bound // block_m, dtype=torch.int32, device=ids.device)
    block = min(1024, max(16, triton.next_power_of_2(n)))
    _place_kernel[(E,)](ids, sorted_pairs, block_expert, n, bound // block_m, E=E,
                        BINS=triton.next_power_of_2(E + 1), BLOCK_M=block_m, BLOCK=block, num_warps=4)
    return sorted_pairs, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs,
                    stride_xm, stride_we, stride_wn, K: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                    E: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= E:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    mask_m = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_ptr + token[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0).to(DOT_DTYPE)
        wmask = mask_k[:, None] & mask_n[None, :]
        g = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0).to(DOT_DTYPE)
        acc_g += tl.dot(a, g, input_precision=DOT_PRECISION)
        if GATED:
            u = tl.load(w_base + (I + offs_n)[None, :] * stride_wn + offs_k[:, None], mask=wmask,
                        other=0.0).to(DOT_DTYPE)
            acc_u += tl.dot(a, u, input_precision=DOT_PRECISION)
    dt = out_ptr.dtype.element_ty
    if GATED:  # rounds like F.silu(gate) * up on the projections in the activation dtype
        g = acc_g.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)
    else:
        r = tl.maximum(acc_g.to(dt).to(tl.float32), 0.0)
        act = r * r
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * I + offs_n[None, :], act.to(dt),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, weights_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs,
                 stride_we, stride_wn, I: tl.constexpr, H: tl.constexpr, E: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= E:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    mask_m = pair < num_pairs
    row = pair.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < I
        a = tl.load(h_ptr + row[:, None] * I + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0).to(DOT_DTYPE)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0).to(DOT_DTYPE)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    weight = tl.load(weights_ptr + row, mask=mask_m, other=0.0)
    tl.store(out_ptr + row[:, None] * H + offs_n[None, :], acc * weight[:, None],
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _sum_slots_kernel(pair_out_ptr, ids_ptr, out_ptr, H: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr,
                      BLOCK: tl.constexpr):
    """out[t] = sum over the token's routed slots j (ids in [0, E)) of pair_out[t * k + j], in
    slot order, float32, rounded once to out's dtype. Slots of no expert were never written."""
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + tok * TOP_K + j)
        routed = (e >= 0) & (e < E)
        # an unrouted slot's row was never written: select 0 (the load stays inside pair_out)
        acc += tl.where(routed, tl.load(pair_out_ptr + (tok * TOP_K + j) * H + offs, mask=mask, other=0.0), 0.0)
    tl.store(out_ptr + tok * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemmTiles:
    """Launch settings of one grouped GEMM: output columns and reduction depth per program."""
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


_DECODE_TILES = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
"""Blocks of 16 pairs (decode-size batches): the best of ``kernel-times fused-moe --sweep`` for both
GEMMs at 1 and 128 tokens (Qwen3-30B-A3B layer): gate_up 23.2 -> 19.4 us at 1 token,
285 -> 271 us at 128; down 11.7 -> 11.2 / 147.6 -> 144.1. Larger blocks keep the defaults
(not swept; deeper K tiles there would need more shared memory per stage)."""


_PREFILL_TILES = GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=3)
"""Blocks of 64 pairs (prefill-size batches): wide output tiles keep the tensor cores fed where
each expert has hundreds of pairs; the best of a joint sweep of block_m / block_n / block_k /
warps / stages at 2,048 and 8,192 tokens of a Qwen3-30B-A3B layer (docs/PERFORMANCE.md, "Kernel
choices"). Taken where the device's shared memory holds its stages (``default_tiles``)."""


_TABLE = (_DECODE_TILES, _PREFILL_TILES, GemmTiles())
"""Every launch setting the defaults take; a fallback picks among these (``launch_limits.fit``)."""


def _footprint(block_m: int, b_tiles: int, a_bytes: int, b_bytes: int):
    def footprint(tiles: GemmTiles) -> launch_limits.Footprint:
        return launch_limits.gemm_footprint(block_m, tiles.block_n, tiles.block_k, tiles.num_stages, tiles.num_warps,
                                            a_bytes, b_bytes, b_tiles)
    return footprint


def default_tiles(block_m: int, b_tiles: int, a_bytes: int, b_bytes: int,
                  limits: launch_limits.DeviceLimits) -> GemmTiles:
    """The launch of one grouped GEMM over blocks of ``block_m`` pairs with ``b_tiles`` weight tiles a
    step (gated gate_up: 2) on operands of ``a_bytes`` / ``b_bytes``: the table's choice for the block
    size where ``limits`` hold it, else the largest that fits (fewer stages first)."""
    preferred = _DECODE_TILES if block_m == 16 else _PREFILL_TILES if block_m == 64 else GemmTiles()
    return launch_limits.fit(preferred, _footprint(block_m, b_tiles, a_bytes, b_bytes), limits, _TABLE)


def _launch_tiles(given: GemmTiles | None, block_m: int, b_tiles: int, a: torch.Tensor, w: torch.Tensor,
                  limits: launch_limits.DeviceLimits) -> GemmTiles:
    a_bytes, b_bytes = a.element_size(), w.element_size()
    if given is None:
        return default_tiles(block_m, b_tiles, a_bytes, b_bytes, limits)
    return launch_limits.check(given, _footprint(block_m, b_tiles, a_bytes, b_bytes)(given), limits)


def _fit(tiles: GemmTiles, n: int, k: int) -> tuple[int, int]:
    """The tile clamped to small dims (tl.dot needs >= 16)."""
    return (min(tiles.block_n, max(16, triton.next_power_of_2(n))),
            min(tiles.block_k, max(16, triton.next_power_of_2(k))))


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small for decode (few pairs per expert), larger for prefill."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, gated: bool, gate_up_tiles: GemmTiles | None = None,
                  down_tiles: GemmTiles | None = None) -> torch.Tensor:
    """See ``kernels.moe_experts.fused_experts``. ``gate_up_tiles`` / ``down_tiles`` override the two
    GEMMs' launch settings (``kernel-times fused-moe --sweep``)."""
    M, K = x.shape
    E, N, _ = w13.shape
    H, I = w2.shape[1], w2.shape[2]
    top_k = topk_ids.shape[1]
    if N != (2 * I if gated else I) or w13.shape[2] != K or w2.shape[0] != E:
        raise ValueError(f"fused_experts: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    num_pairs = M * top_k
    if num_pairs == 0:
        return torch.zeros((M, H), dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:  # rows may be strided (the EP exchange's packed columns): the kernel takes a row stride
        x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    block_m = _block_m(num_pairs, E)
    ids = topk_ids.reshape(-1).to(torch.int32)
    sorted_pairs, block_expert = align_pairs(ids.view(topk_ids.shape), E, block_m)  # int32 already: no second cast
    num_blocks = block_expert.shape[0]
    dots = dot_args(_gate_up_kernel, x.dtype)
    limits = launch_limits.device_limits(x.device)
    tiles = _launch_tiles(gate_up_tiles, block_m, 2 if gated else 1, x, w13, limits)
    block_n, block_k = _fit(tiles, I, K)
    h = torch.empty((num_pairs, I), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(I, block_n))](
        x, w13, h, sorted_pairs, block_expert, num_pairs, x.stride(0), w13.stride(0), w13.stride(1),
        K=K, I=I, TOP_K=top_k, E=E, GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **dots)
    pair_out = torch.empty((num_pairs, H), dtype=torch.float32, device=x.device)  # routed pairs only are written
    tiles = _launch_tiles(down_tiles, block_m, 1, x, w2, limits)
    block_n, block_k = _fit(tiles, H, I)
    _down_kernel[(num_blocks, triton.cdiv(H, block_n))](
        h, w2, topk_weights.contiguous().float(), pair_out, sorted_pairs, block_expert, num_pairs,
        w2.stride(0), w2.stride(1), I=I, H=H, E=E, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **dots)
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(H))
    _sum_slots_kernel[(M, triton.cdiv(H, block))](pair_out, ids, out, H=H, E=E, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out
