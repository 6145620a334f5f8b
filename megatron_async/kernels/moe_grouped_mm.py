"""Routed experts as torch's CUTLASS grouped GEMM (``torch._grouped_mm``), for prefill-size
batches on Hopper, where the fused Triton MoE's GEMMs reach about a third of the tensor cores'
rate (``python -m benchmarks kernel-times fused-moe --grouped-mm`` times both).

1. ``plan_rows`` (two Triton kernels on CUDA, ``triton_moe_plan``; torch ops elsewhere; nothing
   read on the host): the (token, slot) pairs sorted by expert
   (stable: pair order within an expert), each expert's rows padded to a multiple of
   ``ROW_ALIGN`` and to at least ``ROW_ALIGN`` rows (the device-side checks of some torch
   versions' grouped GEMM; no empty group), in a buffer of the static ``pairs + E * ROW_ALIGN``
   rows; ``offs`` the experts' cumulative row ends (int32, on the device).
2. x's rows gathered in that order; grouped GEMM with [gate | up] (a transposed VIEW of w13
   [E, N, K]: the weights are never copied); the activation as the torch reference rounds it;
   grouped GEMM with the down weights (bf16 out, as ``F.linear``). Rows past ``offs[-1]`` are
   gathered but never computed, and never read. On Hopper at ``TRITON_MIN_PAIRS_PER_EXPERT`` or
   more pairs an expert, the plan pads to 128 rows an expert and ``triton_grouped_gemm`` runs
   both GEMMs, the activation in the first one's epilogue (the same roundings).
3. ``combine_slots``: each token's routed slots read back from their rows, times the routing
   weights, added in slot order in float32, rounded once (one Triton kernel on CUDA). Or, when
   the output goes straight into the next block's norm, left to it (``PendingCombine``): one
   kernel sums the slots, adds the residual and normalises, and the [T, H] sum is never stored.

Graph-safe: every shape comes from tensor shapes; the grouped GEMM reads ``offs`` on the
device (its sm90 / sm100 path; others fall back to a per-group loop that syncs, so
``use_grouped_mm`` takes those devices out)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_async.kernels import cuda_device, fused_ops
from megatron_async.kernels.deferred_sum import DeferredSum
from megatron_async.kernels.moe_torch import expert_activation

ROW_ALIGN = 8
"""Rows per expert come in multiples of this: torch 2.8's grouped GEMM asserts on the device that
each group's rows are a multiple of 16 bytes of bf16; a few padding rows per expert cost little."""

MIN_PAIRS_PER_EXPERT = 32
"""``use_grouped_mm`` takes batches with more (token, slot) pairs per expert than this; smaller
batches stay on the fused Triton MoE, whose small blocks suit decode. On an H100, one
Qwen3-30B-A3B layer (``kernel-times fused-moe --grouped-mm``): 512 tokens (32 per expert) tie,
0.52 ms either way; 1,024 tokens 0.56 against 0.63 ms; 8,192 tokens 1.63 against 2.28 ms."""

TRITON_MIN_PAIRS_PER_EXPERT = 256
"""Batches with at least this many (token, slot) pairs per expert run the experts' GEMMs in
``triton_grouped_gemm`` on Hopper (its 128-row tiles pad each expert's rows; fewer pairs an expert
pad more of them). One Qwen3-30B-A3B layer on an H100 (``kernel-times fused-moe --grouped-mm``,
graph ms, CUTLASS + activation / Triton): 1,024 tokens 0.553 / 0.595, 2,048 0.668 / 0.694, 4,096
(256 pairs an expert) 0.915 / 0.890, 8,192 1.499 / 1.410."""

def plan_rows(topk_ids: torch.Tensor, num_experts: int,
              align: int = ROW_ALIGN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [M, k] (ids outside [0, E) = no expert) -> (row_of_pair [M * k]: each pair's row,
    P for a pair of no expert; token_of_row [P]: the token each row reads, 0 on padding rows;
    offs [E] int32: each expert's cumulative row end, its rows a multiple of ``align`` (a power
    of two), at least one), P = M * k + E * align. Rows and tokens are int32 from the kernel
    (CUDA), int64 from ``plan_rows_torch``."""
    if fused_ops.use_fused(topk_ids):
        from megatron_async.kernels import triton_moe_plan

        return triton_moe_plan.plan_rows(topk_ids, num_experts, align)
    return plan_rows_torch(topk_ids, num_experts, align)


def plan_rows_torch(topk_ids: torch.Tensor, num_experts: int,
                    align: int = ROW_ALIGN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``plan_rows`` in torch ops (the CPU path and the kernel's reference)."""
    M, top_k = topk_ids.shape
    E, dev = num_experts, topk_ids.device
    n, P = M * top_k, M * top_k + num_experts * align
    flat = topk_ids.reshape(-1)
    # int32 keys (half the radix passes of int64); E: pairs of no expert sort last
    key = torch.where((flat >= 0) & (flat < E), flat, E).to(torch.int32)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    experts = torch.arange(E, dtype=torch.int32, device=dev)
    # each expert's pairs in the sorted order, found in the sorted keys (no atomics)
    sorted_start = torch.searchsorted(sorted_key, experts)
    sorted_end = torch.searchsorted(sorted_key, experts, right=True)
    rows = ((sorted_end - sorted_start).clamp(min=1) + align - 1) // align * align
    ends = rows.cumsum(0)
    e = sorted_key.clamp(max=E - 1)
    dest = torch.where(sorted_key < E, (ends - rows)[e] + torch.arange(n, device=dev) - sorted_start[e], P)
    row_of_pair = torch.empty_like(dest).scatter_(0, order, dest)
    token_of_row = torch.zeros(P + 1, dtype=torch.int64, device=dev).scatter_(0, dest, order // top_k)[:P]
    return row_of_pair, token_of_row, ends.to(torch.int32)


def combine_slots(y: torch.Tensor, row_of_pair: torch.Tensor | None, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, num_experts: int, out_dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum over t's routed slots j, in slot order, of topk_weights[t, j] * y[row of
    pair t * k + j] (``row_of_pair`` None: row t * k + j, the FP8 MoE's rows in pair order), in
    float32, rounded once to ``out_dtype``. Rows of no expert are never
    read: they may hold anything (the grouped GEMM leaves rows past its groups unwritten). One
    Triton kernel on CUDA (``triton_moe_combine``), else ``combine_slots_torch``."""
    if fused_ops.use_fused(y):
        from megatron_async.kernels import triton_moe_combine

        return triton_moe_combine.combine_slots(y, row_of_pair, topk_ids, topk_weights, num_experts, out_dtype)
    return combine_slots_torch(y, row_of_pair, topk_ids, topk_weights, num_experts, out_dtype)


def combine_slots_torch(y: torch.Tensor, row_of_pair: torch.Tensor | None, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, num_experts: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``combine_slots`` in torch ops (the CPU path and the Triton kernel's reference)."""
    M, top_k = topk_ids.shape
    if row_of_pair is None:
        row_of_pair = torch.arange(M * top_k, device=y.device)
    routed = (topk_ids >= 0) & (topk_ids < num_experts)
    rows = torch.where(routed.reshape(-1), row_of_pair, 0)
    terms = y.index_select(0, rows).view(M, top_k, -1).float() * topk_weights.float().unsqueeze(-1)
    terms = torch.where(routed.unsqueeze(-1), terms, 0.0)
    out = terms[:, 0]
    for j in range(1, top_k):
        out = out + terms[:, j]
    return out.to(out_dtype)


@dataclass(frozen=True)
class PendingCombine(DeferredSum):
    """``combine_slots``' arguments, its sum left to the next block's norm: on CUDA one kernel
    (``triton_moe_combine.combine_add_rms_norm``) sums the slots, adds the residual and
    normalises, bit for bit as ``combine_slots`` then ``fused_ops.add_rms_norm``."""

    y: torch.Tensor
    row_of_pair: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_experts: int
    out_dtype: torch.dtype

    def reduce(self) -> torch.Tensor:
        return combine_slots(self.y, self.row_of_pair, self.topk_ids, self.topk_weights, self.num_experts,
                             self.out_dtype)

    def add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     cast_before_weight: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not combine_fuses_norm(self, residual, weight):
            return None
        from megatron_async.kernels import triton_moe_combine

        return triton_moe_combine.combine_add_rms_norm(self.y, self.row_of_pair, self.topk_ids, self.topk_weights,
                                                       self.num_experts, residual, weight, eps, cast_before_weight)


def combine_fuses_norm(pending: PendingCombine, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the one-kernel slot sum + add + norm takes these tensors: CUDA, and the sum, the
    residual stream and the norm weight in one dtype (a float32 residual stream reduces first)."""
    return (fused_ops.use_fused(pending.y) and pending.out_dtype == residual.dtype == weight.dtype
            and residual.shape == (pending.topk_ids.shape[0], pending.y.shape[1]))


def fused_experts_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                             topk_weights: torch.Tensor, gated: bool, defer_combine: bool = False,
                             triton_grouped_gemm: bool = True) -> torch.Tensor | PendingCombine:
    """See ``kernels.moe_experts.fused_experts``. Takes the dtypes ``torch._grouped_mm`` takes on
    the device (bf16 on CUDA, with K and I multiples of 8). ``defer_combine``: return the last
    step as a ``PendingCombine`` for the next block's norm. ``triton_grouped_gemm`` False: the
    GEMMs stay on torch's grouped GEMM whatever the batch (``use_triton_experts`` not asked)."""
    M, K = x.shape
    E, N, _ = w13.shape
    H, I = w2.shape[1], w2.shape[2]
    if N != (2 * I if gated else I) or w13.shape[2] != K or w2.shape[0] != E:
        raise ValueError(f"fused_experts_grouped_mm: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} "
                         f"do not fit x {tuple(x.shape)}")
    if M == 0 or topk_ids.shape[1] == 0:
        return torch.zeros((M, H), dtype=x.dtype, device=x.device)
    if triton_grouped_gemm and use_triton_experts(x, w13, w2, topk_ids):
        from megatron_async.kernels import triton_grouped_gemm

        row_of_pair, token_of_row, offs = plan_rows(topk_ids, E, triton_grouped_gemm.row_tile(x.device))
        y = triton_grouped_gemm.experts(_gather(x, token_of_row, offs), w13, w2, offs, gated)
    else:
        row_of_pair, token_of_row, offs = plan_rows(topk_ids, E)
        act = _activation(torch._grouped_mm(_gather(x, token_of_row, offs), w13.transpose(1, 2), offs=offs), gated)
        y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
        del act  # each [rows, *] buffer lives only while the next step reads it: the step's peak memory
    if defer_combine:
        return PendingCombine(y, row_of_pair, topk_ids, topk_weights, E, x.dtype)
    return combine_slots(y, row_of_pair, topk_ids, topk_weights, E, x.dtype)


def _gather(x: torch.Tensor, token_of_row: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x's rows in the plan's order (one Triton kernel on CUDA; rows past the groups unwritten)."""
    if fused_ops.use_fused(x) and x.stride(1) == 1:
        from megatron_async.kernels import triton_moe_plan

        return triton_moe_plan.gather_rows(x, token_of_row, offs)
    return x.index_select(0, token_of_row)


def _activation(h: torch.Tensor, gated: bool) -> torch.Tensor:
    """``expert_activation`` (one Triton kernel for SwiGLU on CUDA, rounding as the torch ops)."""
    return fused_ops.silu_and_mul(h) if gated and fused_ops.use_fused(h) else expert_activation(h, gated)


def triton_experts_allowed(num_experts: int, topk_ids: torch.Tensor) -> bool:
    """The batch rule of both Triton grouped paths (bf16 here, FP8 in ``triton_fp8_grouped``): at
    least ``TRITON_MIN_PAIRS_PER_EXPERT`` pairs an expert."""
    return topk_ids.numel() >= TRITON_MIN_PAIRS_PER_EXPERT * num_experts


def use_triton_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether ``fused_experts_grouped_mm`` runs its GEMMs in ``triton_grouped_gemm``: CUDA, a batch
    ``triton_experts_allowed`` takes, operands it takes. Shapes and the device only, as
    ``use_grouped_mm``."""
    if not x.is_cuda or not triton_experts_allowed(w13.shape[0], topk_ids):
        return False
    from megatron_async.kernels import triton_grouped_gemm

    return triton_grouped_gemm.takes(x, w13, w2)


def use_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether the fused-MoE backend hands these experts to ``fused_experts_grouped_mm``: a CUDA
    device whose grouped GEMM reads the offsets on the device (capability 9.x / 10.x) and
    operands ``grouped_mm_suits``. Shapes and the device only: every replay of a graph takes
    the path its capture took."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and grouped_mm_suits(x, w13, w2, topk_ids)):
        return False
    return cuda_device.capability(x.device)[0] in (9, 10)


def grouped_mm_suits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """bf16 x and weights with 16-byte-aligned rows (K, I multiples of 8, unit last strides,
    16-byte-aligned weight pointers), fewer than 1,024 experts, more than
    ``MIN_PAIRS_PER_EXPERT`` (token, slot) pairs per expert."""
    E, I = w13.shape[0], w2.shape[2]
    pairs = topk_ids.numel()
    return (x.dtype == w13.dtype == w2.dtype == torch.bfloat16
            and x.shape[1] % 8 == 0 and I % 8 == 0 and w13.stride(2) == 1 and w2.stride(2) == 1
            and w13.stride(1) % 8 == 0 and w2.stride(1) % 8 == 0 and E < 1024
            and w13.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0
            and pairs > MIN_PAIRS_PER_EXPERT * min(E, pairs))

