"""The last step of the grouped-GEMM MoE (``moe_grouped_mm``) in one kernel: each token's routed
slots gathered back from the expert-sorted rows, times their routing weights, added in slot
order in float32 and rounded once. Reads the bf16 rows once (no float32 [pairs, H] buffer, no
atomics: the result does not depend on the schedule). Graph-safe: the grid comes from shapes.

``combine_add_rms_norm`` goes on into the next block's residual add and RMSNorm in the same
kernel (``moe_grouped_mm.PendingCombine``): the [T, H] sum is never written nor read back, and
the bits equal ``combine_slots`` then ``triton_rmsnorm.add_rms_norm`` (the two share their
row code: ``slot_sum``, ``add_norm_row``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels import triton_rmsnorm
from megatron_async.kernels.triton_rmsnorm import add_norm_row


@triton.jit
def slot_sum(y_ptr, rows_ptr, ids_ptr, weights_ptr, tok, offs, mask, stride_y, E: tl.constexpr, TOP_K: tl.constexpr,
             BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Token ``tok``'s columns ``offs``: the sum over its slots, in slot order, of weight * row, float32.
    ``ROWS``: each pair's row read from ``rows_ptr``; else pair t * k + j is row t * k + j."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = tok * TOP_K + j
        e = tl.load(ids_ptr + pair)
        routed = (e >= 0) & (e < E)
        # a pair of no expert has no row: it reads row 0 (one row for all of them, from L2) and drops it
        if ROWS:
            row = tl.where(routed, tl.load(rows_ptr + pair), 0).to(tl.int64)
        else:
            row = tl.where(routed, pair, 0).to(tl.int64)
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.where(routed, y * tl.load(weights_ptr + pair), 0.0)  # a weight of no expert may be anything
    return acc


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, ids_ptr, weights_ptr, out_ptr, stride_y, H: tl.constexpr, E: tl.constexpr,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = slot_sum(y_ptr, rows_ptr, ids_ptr, weights_ptr, tok, offs, mask, stride_y, E, TOP_K, BLOCK, ROWS)
    tl.store(out_ptr + tok * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_norm_kernel(y_ptr, rows_ptr, ids_ptr, weights_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_y,
                         stride_r, eps, H: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                         CAST_BEFORE_WEIGHT: tl.constexpr, ROWS: tl.constexpr):
    # one program per token over its whole row (the norm reduces the row); the slot sum of a
    # column does not depend on how the row is cut, so it rounds as ``_combine_kernel``'s
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    acc = slot_sum(y_ptr, rows_ptr, ids_ptr, weights_ptr, tok, offs, mask, stride_y, E, TOP_K, BLOCK, ROWS)
    r = tl.load(res_ptr + tok * stride_r + offs, mask=mask, other=0.0)
    add_norm_row(acc.to(out_ptr.dtype.element_ty), r, w_ptr, out_ptr, res_out_ptr, tok, offs, mask, eps, H, True,
                 CAST_BEFORE_WEIGHT)


def combine_slots(y: torch.Tensor, row_of_pair: torch.Tensor | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  num_experts: int, out_dtype: torch.dtype) -> torch.Tensor:
    """See ``moe_grouped_mm.combine_slots`` (torch reference: ``combine_slots_torch``)."""
    M, top_k = topk_ids.shape
    H = _check_rows(y)
    out = torch.empty((M, H), dtype=out_dtype, device=y.device)
    if M == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(M, triton.cdiv(H, block))](
        y, _rows(row_of_pair, topk_ids), topk_ids.contiguous(), topk_weights.contiguous().float(), out, y.stride(0),
        H=H, E=num_experts, TOP_K=top_k, BLOCK=block, ROWS=row_of_pair is not None, num_warps=4)
    return out


def combine_add_rms_norm(y: torch.Tensor, row_of_pair: torch.Tensor | None, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, num_experts: int, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float, cast_before_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s + residual), s + residual) of s = ``combine_slots(...)`` in residual's dtype, in
    one kernel, bit for bit as ``combine_slots`` then ``triton_rmsnorm.add_rms_norm``."""
    M, top_k = topk_ids.shape
    H = _check_rows(y)
    if residual.shape != (M, H) or weight.shape != (H,) or residual.dtype != weight.dtype or H > triton_rmsnorm.MAX_HIDDEN:
        raise ValueError(f"combine_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype} do not fit {M} tokens of {H}")
    if residual.stride(1) != 1:
        residual = residual.contiguous()
    out = torch.empty((M, H), dtype=residual.dtype, device=y.device)
    res_out = torch.empty_like(out)
    if M == 0:
        return out, res_out
    block = triton.next_power_of_2(H)
    _combine_norm_kernel[(M,)](
        y, _rows(row_of_pair, topk_ids), topk_ids.contiguous(), topk_weights.contiguous().float(), residual, weight, out,
        res_out, y.stride(0), residual.stride(0), eps, H=H, E=num_experts, TOP_K=top_k, BLOCK=block,
        # the norm kernel's warps for the same row width: its row sum then adds in the same order
        CAST_BEFORE_WEIGHT=cast_before_weight, ROWS=row_of_pair is not None, num_warps=triton_rmsnorm.num_warps(block))
    return out, res_out


def _rows(row_of_pair: torch.Tensor | None, topk_ids: torch.Tensor) -> torch.Tensor:
    """The rows argument: ``row_of_pair``, or (rows in pair order) the ids, never read as rows."""
    return topk_ids.contiguous() if row_of_pair is None else row_of_pair.contiguous()


def _check_rows(y: torch.Tensor) -> int:
    """y's row width; its rows must have a unit last stride."""
    if y.stride(1) != 1:
        raise ValueError(f"combine_slots: expert rows need a unit last stride, got strides {y.stride()}")
    return y.shape[1]
