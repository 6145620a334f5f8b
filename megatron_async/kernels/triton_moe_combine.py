"""The last step of the grouped-GEMM MoE (``moe_grouped_mm``) in one kernel: each token's routed
slots gathered back from the expert-sorted rows, times their routing weights, added in slot
order in float32 and rounded once. Reads the bf16 rows once (no float32 [pairs, H] buffer, no
atomics: the result does not depend on the schedule). Graph-safe: the grid comes from shapes."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, ids_ptr, weights_ptr, out_ptr, stride_y, H: tl.constexpr, E: tl.constexpr,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = tok * TOP_K + j
        e = tl.load(ids_ptr + pair)
        routed = (e >= 0) & (e < E)
        # a pair of no expert has no row: it reads row 0 (one row for all of them, from L2) and drops it
        row = tl.where(routed, tl.load(rows_ptr + pair), 0).to(tl.int64)
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.where(routed, y * tl.load(weights_ptr + pair), 0.0)  # a weight of no expert may be anything
    tl.store(out_ptr + tok * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_slots(y: torch.Tensor, row_of_pair: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  num_experts: int, out_dtype: torch.dtype) -> torch.Tensor:
    """See ``moe_grouped_mm.combine_slots`` (torch reference: ``combine_slots_torch``)."""
    M, top_k = topk_ids.shape
    H = y.shape[1]
    if y.stride(1) != 1:
        raise ValueError(f"combine_slots: expert rows need a unit last stride, got strides {y.stride()}")
    out = torch.empty((M, H), dtype=out_dtype, device=y.device)
    if M == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(M, triton.cdiv(H, block))](
        y, row_of_pair.contiguous(), topk_ids.contiguous(), topk_weights.contiguous().float(), out, y.stride(0),
        H=H, E=num_experts, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out
