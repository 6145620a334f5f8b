"""A step's tokens grouped by LoRA adapter slot, once per forward, for every adapted linear of the
step (``ForwardBatch.lora_groups``; the grouped kernels: ``triton_lora_grouped``).

Built on the device from the snapshot's ``lora_slot`` column by a few torch ops (compare, cumsum,
scatter, searchsorted): no host read and no data-dependent size, so it runs inside the forward a
CUDA graph captures and is replayed with the step's slots. The host alternative (sorting in the
snapshot builders) would put a per-step sort on the CPU's critical path of every row builder
(decode, general, padding) and grow the one H2D copy by a table that depends on the tile size;
on the device it is a few microseconds of tiny kernels, once per step, against 4 x layers LoRA
ops that read it.

No sort: a token's position is its slot's start plus how many earlier tokens share its slot (a
cumsum of the one-hot [L + 1, T] slot matrix), so the order is stable and deterministic."""
from __future__ import annotations

import torch

from megatron_async.forward_batch import LoRAGroups


GROUPED_MIN_ROWS = 2
"""Below this many tokens a step's LoRA ops mask instead of grouping (batch-invariant mode always
groups when it groups at all): at one row the masked ops of a Qwen3-8B step took 0.85 ms against
0.92 grouped plus the grouping's ~0.06 (``kernel-times lora``)."""


def max_tiles(rows: int, num_slots: int, block_m: int) -> int:
    """Most tiles of ``block_m`` rows of one slot that ``rows`` tokens over ``num_slots`` slots need:
    each non-empty slot wastes at most ``block_m - 1`` rows of its last tile."""
    return max(1, (rows + min(num_slots, rows) * (block_m - 1)) // block_m)


def group_lora_rows(slots: torch.Tensor, num_slots: int, batch_invariant: bool) -> LoRAGroups:
    """``slots`` [T] int32 (each in [-1, num_slots)) -> their ``LoRAGroups`` in the tiles the grouped
    LoRA op takes for T rows in this mode."""
    from megatron_async.kernels.triton_lora_grouped import grouped_tiles  # kernels decorated on first use

    T, L, dev = slots.shape[0], num_slots, slots.device
    block_m = grouped_tiles(T, batch_invariant).block_m
    key = torch.where(slots >= 0, slots, L).long()  # slot -1 sorts last, as slot L
    onehot = (key.unsqueeze(0) == torch.arange(L + 1, device=dev).unsqueeze(1)).to(torch.int32)
    seen = onehot.cumsum(1, dtype=torch.int32)  # [L + 1, T]: tokens of each slot up to and with t
    counts = seen[:, -1] if T else torch.zeros(L + 1, dtype=torch.int32, device=dev)
    slot_starts = torch.zeros(L + 2, dtype=torch.int32, device=dev)
    slot_starts[1:] = counts.cumsum(0, dtype=torch.int32)
    pos = slot_starts[key] + seen.gather(0, key.unsqueeze(0)).squeeze(0) - 1
    order = torch.empty(T, dtype=torch.int32, device=dev)
    order.scatter_(0, pos.long(), torch.arange(T, dtype=torch.int32, device=dev))
    per_slot = (counts[:L] + block_m - 1) // block_m
    ends = per_slot.cumsum(0, dtype=torch.int32)  # tile i belongs to the first slot whose end exceeds i
    tile = torch.arange(max_tiles(T, L, block_m), dtype=torch.int32, device=dev)
    owner = torch.searchsorted(ends, tile, right=True)
    used = owner < L
    lora = owner.clamp(max=L - 1)
    nth = tile - (ends[lora] - per_slot[lora])  # the tile's index within its slot
    first = slot_starts[lora] + nth * block_m
    rows = (counts[lora] - nth * block_m).clamp(0, block_m)
    table = torch.stack([torch.where(used, lora, -1), torch.where(used, first, 0), torch.where(used, rows, 0)], 1)
    return LoRAGroups(slots=slots, order=order, slot_starts=slot_starts, tiles=table.to(torch.int32).contiguous(),
                      block_m=block_m)
