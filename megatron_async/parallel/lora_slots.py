"""The LoRA adapter slots of one parallel linear, sharded like the linear they adapt.

Allocated once (so captured CUDA graphs stay valid): ``a`` [max_loras, parts * max_rank, in] and
``b`` [max_loras, out, max_rank] in the model dtype, ``scale`` [max_loras, parts] float32. A fused
linear (q/k/v, gate/up) has one part per HF projection it stacks, each with its own A rows
(``a[l, j*R:(j+1)*R]``) and its own output columns (``slices[j]``); an adapter of rank r < R fills
the first r rows / columns and leaves zeros, which add exact zeros.

Tensor parallelism follows the linear's own ``Sharding``: column-parallel, A whole and B cut on
its output rows exactly as the weight's part is; row-parallel, A cut on its input columns as the
weight is and B whole, so the LoRA product of this rank's input shard is a partial sum that joins
the layer's partial sum before the all-reduce."""
from __future__ import annotations

import torch

from megatron_async.forward_batch import LoRAGroups
from megatron_async.kernels.lora_ops import lora_add
from megatron_async.parallel.sharding import ShardId, Sharding


class LoRASlots:
    def __init__(self, weight: torch.Tensor, part_ids: tuple[ShardId, ...], part_sizes: list[int], max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device | str):
        """``weight``: the adapted linear's (this rank's) weight with its ``sharding``; ``part_ids``:
        the shard id of each stacked part (None for a plain linear), ``part_sizes`` their local
        output sizes (one part of all columns for a row-parallel linear)."""
        out_local, in_local = weight.shape
        self.sharding: Sharding = weight.sharding
        if self.sharding.dim not in (0, 1):
            raise ValueError("LoRA adapts column- or row-parallel linears only")
        self.row_parallel = self.sharding.dim == 1
        self.part_ids, self.max_rank = tuple(part_ids), max_rank
        S, R = len(part_ids), max_rank
        self.a = torch.zeros(max_loras, S * R, in_local, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_local, R, dtype=dtype, device=device)
        self.scale = torch.zeros(max_loras, S, dtype=torch.float32, device=device)
        bounds = [0]
        for size in part_sizes:
            bounds.append(bounds[-1] + size)
        assert bounds[-1] == out_local, (part_sizes, out_local)
        self.slices = tuple(zip(bounds[:-1], bounds[1:]))
        self.starts = torch.tensor(bounds, dtype=torch.int32, device=device)

    def part_of(self, shard_id: ShardId) -> int:
        """The part index of an HF tensor's shard id (the stacked projection it stands for)."""
        return self.part_ids.index(shard_id)

    def full_shapes(self, part: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The checkpoint shapes (A [rank, in], B [out, rank]) of part ``part``'s adapter tensors."""
        if self.row_parallel:
            return self.sharding.full_shape((rank, self.a.shape[2])), (self.b.shape[1], rank)
        lo, hi = self.slices[part]
        return (rank, self.a.shape[2]), self.sharding.full_shape((hi - lo, rank), self.part_ids[part])

    def slot_views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(a, b, scale) of slot ``slot``: the shapes of an adapter's image (models/lora/staging.py)."""
        return self.a[slot], self.b[slot], self.scale[slot]

    @torch.no_grad()
    def write(self, slot: int, part: int, a_full: torch.Tensor | None, b_full: torch.Tensor | None,
              scale: float) -> None:
        """Slot ``slot``, part ``part``: this rank's share of full tensors A [r, in] and B [out, r]
        (shapes checked by the caller against ``full_shapes``); None: the adapter leaves this part
        alone (zeros)."""
        self.write_image(self.slot_views(slot), part, a_full, b_full, scale)

    @torch.no_grad()
    def write_image(self, image: tuple[torch.Tensor, torch.Tensor, torch.Tensor], part: int,
                    a_full: torch.Tensor | None, b_full: torch.Tensor | None, scale: float) -> None:
        """``write`` into ``image`` (tensors shaped like ``slot_views``: a slot or a staged copy of one)."""
        a_slot, b_slot, scale_slot = image
        R = self.max_rank
        a_rows = a_slot[part * R:(part + 1) * R]
        lo, hi = self.slices[part]
        b_cols = b_slot[lo:hi]
        a_rows.zero_()
        b_cols.zero_()
        scale_slot[part] = 0.0 if a_full is None else scale
        if a_full is None:
            return
        r = a_full.shape[0]
        if self.row_parallel:
            for dest in self.sharding.destinations(a_rows[:r]):
                dest.view.copy_(a_full[:, dest.box.lo[1]:dest.box.hi[1]])
            b_cols[:, :r].copy_(b_full)
            return
        a_rows[:r].copy_(a_full)
        part_view = b_slot[:, :r]
        for dest in self.sharding.destinations(part_view, self.part_ids[part]):
            dest.view.copy_(b_full[dest.box.lo[0]:dest.box.hi[0]])

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scale[slot].zero_()

    def apply(self, x: torch.Tensor, y: torch.Tensor, token_slots: torch.Tensor | LoRAGroups,
              batch_invariant: bool) -> None:
        """``y`` (this layer's output or partial sum for input ``x``) += each token's adapter's product;
        ``token_slots``: each token's slot, or the step's grouping of them (``ForwardBatch.lora_rows``)."""
        groups = token_slots if isinstance(token_slots, LoRAGroups) else None
        slots = groups.slots if groups is not None else token_slots
        lora_add(y, x, self.a, self.b, self.scale, slots, self.starts, self.slices, batch_invariant, groups)
