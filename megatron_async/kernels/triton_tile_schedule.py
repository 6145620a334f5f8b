"""The varlen attention kernels' tile schedule: a step's query tiles (up to BLOCK_Q consecutive
tokens of one row), most keys first, computed once per step on the device and shared by every
layer (see triton_prefill_attention's module docstring)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.forward_batch import AttentionMetadata


@triton.jit(do_not_specialize=["num_rows", "num_slots", "search_steps", "min_query", "max_query"])  # any step
def _schedule_kernel(cu_q_ptr, kv_lens_ptr, work_ptr, entry_ptr, num_rows, num_slots, search_steps, min_query,
                     max_query, BLOCK_Q: tl.constexpr, BLOCK: tl.constexpr):
    """Per tile slot: its (row, first query) packed as ``row << 32 | q_first`` and its keys (the
    last query's position + 1), or -1 / -1 for an empty slot or a row of fewer than ``min_query``
    or more than ``max_query`` query tokens."""
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = slot < num_slots
    # the slot's row: the last r with cu_query_lens[r] // BLOCK_Q + r <= slot (binary search)
    lo = tl.zeros([BLOCK], tl.int32)
    hi = lo + num_rows
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go = hi - lo > 1
        right = (tl.load(cu_q_ptr + mid, mask=go, other=0) // BLOCK_Q + mid) <= slot
        lo = tl.where(go & right, mid, lo)
        hi = tl.where(go & ~right, mid, hi)
    q_begin = tl.load(cu_q_ptr + lo, mask=in_range, other=0)
    q_len = tl.load(cu_q_ptr + lo + 1, mask=in_range, other=0) - q_begin
    q_first = (slot - (q_begin // BLOCK_Q + lo)) * BLOCK_Q
    live = in_range & (q_first < q_len) & (q_len >= min_query) & (q_len <= max_query)
    kv_len = tl.load(kv_lens_ptr + lo, mask=in_range, other=0)
    keys = kv_len - q_len + tl.minimum(q_first + BLOCK_Q, q_len)  # a row's queries end at position kv_len - 1
    tl.store(work_ptr + slot, tl.where(live, keys, -1), mask=in_range)
    tl.store(entry_ptr + slot, tl.where(live, (lo.to(tl.int64) << 32) | q_first.to(tl.int64), -1), mask=in_range)


def tile_schedule(meta: AttentionMetadata, block_q: int, num_slots: int, min_query: int = 0,
                  max_query: int = 2**31 - 1) -> torch.Tensor:
    """int64 [num_slots]: the step's tiles as ``row << 32 | first query``, most keys first, -1
    for empty slots (last); only rows of ``min_query`` to ``max_query`` query tokens (two kernels
    sharing a step's rows). Computed by the first layer that asks and kept on ``meta`` (one
    step's metadata) for the others; a few launches, inside the step's graph when captured."""
    key = ("prefill_schedule", block_q, num_slots, min_query, max_query)
    if key not in meta.scratch:
        dev = meta.cu_query_lens.device
        work = torch.empty(num_slots, dtype=torch.int32, device=dev)
        entry = torch.empty(num_slots, dtype=torch.int64, device=dev)
        block = 1024
        _schedule_kernel[(triton.cdiv(num_slots, block),)](
            meta.cu_query_lens, meta.kv_lens, work, entry, meta.num_rows, num_slots, meta.num_rows.bit_length(),
            min_query, max_query, BLOCK_Q=block_q, BLOCK=block)
        meta.scratch[key] = entry[torch.argsort(work, descending=True)]
    return meta.scratch[key]
