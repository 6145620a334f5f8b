"""The flash-decoding merge of a decode step's splits (triton_decode_attention): each split of a
row's keys leaves, per query head, a normalised partial output and its log-sum-exp (log2); the
head's output is the partials weighted by exp2(lse - max lse), over the weights' sum.

The split kernel merges in its own tail (``merge_group_if_last``): the last of a (row, KV head)
group's programs to finish merges the group's query heads, so a step pays no second launch (in a
CUDA graph each launch leaves a ~1-2 us gap; a Qwen3-8B decode step at batch 1 paid 36 merge
launches, 60-100 us of 2.4 ms). After its partial stores a program passes a block barrier (every
thread's stores come before the count) and adds one to the group's arrival counter (acq_rel, GPU
scope); the program that reads ``num_splits - 1`` has acquired every other program's partials,
zeroes the counter and reads them through L2 (``.cg``: its L1 holds nothing it could have seen
before). No program waits for another, so the grid need not be resident at once.
``_decode_merge_kernel`` runs the same per-head merge (``merge_head``, so the same bits) as a
second launch: ``decode_attention(merge_in_kernel=False)``, for tests and the A/B timing.

Counters (``arrival_counters``): one int32 per (row, KV head) in ``meta.scratch``, zeroed by the
step's first layer that needs them and left zero by every launch (the merging program resets its
group's), so the next layer, which the stream runs after this one, finds them zero. Under a CUDA
graph the ``torch.zeros`` is captured as a memset node that every replay runs before the step's
first decode launch, so a replay never relies on the bytes having stayed zero since the last one
(another graph sharing the memory pool may have used them); their count comes from the shapes
alone (rows x KV heads), never from the step's data, like everything the host decides here. Calls
sharing one metadata object run in stream order (one stream, as a step's layers do)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.forward_batch import AttentionMetadata
from megatron_async.kernels.triton_fp8_act import store_heads_quantized
from megatron_async.kernels.triton_fp8_common import emulate

ARRIVALS_KEY = "decode_arrivals"
"""``meta.scratch`` key of the step's arrival counters."""


def merge_block(num_splits: int) -> int:
    """Splits one merge reads at once (``BLOCK_S``): a power of two, at least 16 so the split kernel,
    which takes it as a constant, compiles one binary for up to 16 splits rather than one per power
    of two (empty lanes are masked loads: -inf / 0, weight 0)."""
    return max(16, triton.next_power_of_2(num_splits))


def arrival_counters(meta: AttentionMetadata, count: int, device: torch.device) -> torch.Tensor:
    """The step's arrival counters, at least ``count`` of them, zero between launches: made (or
    grown) by the first call that needs them, reused by the step's later layers."""
    counters = meta.scratch.get(ARRIVALS_KEY)
    if counters is None or counters.numel() < count or counters.device != device:
        counters = meta.scratch[ARRIVALS_KEY] = torch.zeros(count, dtype=torch.int32, device=device)
    return counters


@triton.jit
def merge_head(
    part_out_ptr, part_lse_ptr, out_ptr, row, head, live, stride_ot, stride_oh, num_heads, num_splits,
    oq_ptr, os_ptr, rows_padded,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUANT_OUT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Query head ``head`` of row ``row`` (int64): its splits' partials weighted by exp2(lse_s - max
    lse), over the weights' sum. Splits from ``live`` on are not read: they are empty, and the masked
    loads give what they stored (lse -inf, output 0)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < live
    d_mask = offs_d < HEAD_DIM
    part = (row * num_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0.0, den, 1.0)
    if QUANT_OUT:  # one head = one 128-wide group of the o projection's input
        one = tl.arange(0, 1)
        store_heads_quantized(tl.reshape(res, [1, BLOCK_D]), row + one, head + one, one == 0, oq_ptr, os_ptr,
                              rows_padded, num_heads * 128, out_ptr.dtype.element_ty, EMULATE)
    else:
        tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
                 mask=d_mask)


@triton.jit
def merge_group_if_last(
    arrivals_ptr, part_out_ptr, part_lse_ptr, out_ptr, row, kv_head, num_kv_heads, live, stride_ot, stride_oh,
    num_heads, num_splits, oq_ptr, os_ptr, rows_padded,
    GROUP: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT_OUT: tl.constexpr, EMULATE: tl.constexpr,
):
    """Count this program's split in on its (row, KV head) group; the group's last program to arrive
    zeroes the counter and merges the group's query heads (module docstring)."""
    counter = arrivals_ptr + row * num_kv_heads + kv_head
    tl.debug_barrier()  # every thread's partial stores come before the program counts itself in
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        tl.store(counter, 0)  # nothing else touches it before the next launch, which runs after this one
        for g in tl.static_range(GROUP):
            merge_head(part_out_ptr, part_lse_ptr, out_ptr, row.to(tl.int64), kv_head * GROUP + g, live,
                       stride_ot, stride_oh, num_heads, num_splits, oq_ptr, os_ptr, rows_padded,
                       BLOCK_S, HEAD_DIM, BLOCK_D, QUANT_OUT, EMULATE)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads, num_splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    oq_ptr, os_ptr, rows_padded, QUANT_OUT: tl.constexpr, EMULATE: tl.constexpr,
):
    # One program per (row, query head), every split read (the row's length is not passed).
    merge_head(part_out_ptr, part_lse_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), num_splits,
               stride_ot, stride_oh, num_heads, num_splits, oq_ptr, os_ptr, rows_padded,
               BLOCK_S, HEAD_DIM, BLOCK_D, QUANT_OUT, EMULATE)


def split_partials(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's fp32 partial outputs [R, H, S, D] and log-sum-exps [R, H, S] (unwritten)."""
    rows, heads, head_dim = q.shape
    return (torch.empty(rows, heads, num_splits, head_dim, device=q.device, dtype=torch.float32),
            torch.empty(rows, heads, num_splits, device=q.device, dtype=torch.float32))


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, block_d: int,
                 quant_args: dict) -> None:
    """The merge as its own launch over (rows, query heads), into ``out`` (or the quantized rows)."""
    rows, heads, num_splits, head_dim = part_out.shape
    _decode_merge_kernel[(rows, heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), heads, num_splits,
        BLOCK_S=merge_block(num_splits), HEAD_DIM=head_dim, BLOCK_D=block_d, **quant_args,
        EMULATE=emulate(_decode_merge_kernel), num_warps=4,
    )
