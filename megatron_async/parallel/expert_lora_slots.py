"""The LoRA adapter slots of one routed-experts linear (``ExpertParallelLinear``): every adapter
slot holds an (A, B) pair per local expert and per stacked part (gate / up).

Allocated once (captured CUDA graphs stay valid): ``a`` [max_loras, E_local, parts * max_rank,
in], ``b`` [max_loras, E_local, out, max_rank] in the model dtype, ``scale`` [max_loras, E_local,
parts] float32 (the adapter's scale where it adapts that expert's part, else 0). Flattened over
(adapter slot, expert), they are ``lora_ops.lora_add``'s slot tables: a routed (token, expert)
row of adapter slot l and local expert e reads entry ``l * E_local + e``, so the one batched
LoRA op serves experts as it serves dense linears.

Expert parallelism: each rank keeps its local experts' adapters (the whole adapter is checked on
every rank; other ranks' experts are not kept). Tensor-parallel experts (an expert's matrix cut
over the TP group) take no slots: ``supports`` says so and loading such an adapter is refused."""
from __future__ import annotations

import torch

from megatron_async.kernels.lora_ops import lora_add
from megatron_async.parallel.sharding import ShardId


class ExpertLoRASlots:
    def __init__(self, linear, output_sizes: list[int], max_loras: int, max_rank: int):
        """``linear``: an ``ExpertParallelLinear`` (TP size 1); ``output_sizes``: its stacked parts'
        rows (one part for the down projection)."""
        weight = linear.weight
        E, out, K = weight.shape
        self.sharding = weight.sharding
        self.num_local, self.first_expert = E, linear.first_expert
        self.part_ids = tuple(self.sharding.inner.shard_ids or (None,))
        self.max_rank, S, R = max_rank, len(self.part_ids), max_rank
        dev, dtype = weight.device, weight.dtype
        self.a = torch.zeros(max_loras, E, S * R, K, dtype=dtype, device=dev)
        self.b = torch.zeros(max_loras, E, out, R, dtype=dtype, device=dev)
        self.scale = torch.zeros(max_loras, E, S, dtype=torch.float32, device=dev)
        bounds = [0]
        for size in output_sizes:
            bounds.append(bounds[-1] + size)
        assert bounds[-1] == out, (output_sizes, out)
        self.slices = tuple(zip(bounds[:-1], bounds[1:]))
        self.starts = torch.tensor(bounds, dtype=torch.int32, device=dev)

    @staticmethod
    def supports(linear) -> bool:
        """Whether ``linear``'s experts can take slots: whole experts on this rank (TP size 1), not FP8."""
        return linear.parallel.tp_size == 1 and linear.weight_scale_inv is None

    def part_of(self, shard_id: ShardId) -> tuple[int, int]:
        """The (global expert, part index) an HF expert tensor's shard id (expert, part) stands for."""
        expert, part = shard_id
        return expert, self.part_ids.index(part)

    def full_shapes(self, part: tuple[int, int], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The checkpoint shapes (A [rank, in], B [out, rank]) of one expert's part's adapter tensors."""
        lo, hi = self.slices[part[1]]
        return (rank, self.a.shape[3]), (hi - lo, rank)

    def slot_views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(a, b, scale) of slot ``slot``: the shapes of an adapter's image (models/lora/staging.py)."""
        return self.a[slot], self.b[slot], self.scale[slot]

    @torch.no_grad()
    def write(self, slot: int, part: tuple[int, int], a_full: torch.Tensor | None, b_full: torch.Tensor | None,
              scale: float) -> None:
        """Slot ``slot``, expert ``part[0]``'s part ``part[1]``: A [r, in] and B [out, r] (None: zeros);
        another EP rank's expert is not kept here."""
        self.write_image(self.slot_views(slot), part, a_full, b_full, scale)

    @torch.no_grad()
    def write_image(self, image: tuple[torch.Tensor, torch.Tensor, torch.Tensor], part: tuple[int, int],
                    a_full: torch.Tensor | None, b_full: torch.Tensor | None, scale: float) -> None:
        """``write`` into ``image`` (tensors shaped like ``slot_views``: a slot or a staged copy of one)."""
        expert, j = part
        e = expert - self.first_expert
        if not 0 <= e < self.num_local:
            return
        a_slot, b_slot, scale_slot = image
        R = self.max_rank
        lo, hi = self.slices[j]
        a_rows, b_cols = a_slot[e, j * R:(j + 1) * R], b_slot[e, lo:hi]
        a_rows.zero_()
        b_cols.zero_()
        scale_slot[e, j] = 0.0 if a_full is None else scale
        if a_full is not None:
            r = a_full.shape[0]
            a_rows[:r].copy_(a_full)
            b_cols[:, :r].copy_(b_full)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scale[slot].zero_()

    def apply_rows(self, y: torch.Tensor, x: torch.Tensor, row_entries: torch.Tensor, batch_invariant: bool) -> None:
        """``y`` [rows, out] += each row's adapter product of ``x`` [rows, in]; ``row_entries`` [rows]
        int32: ``slot * E_local + local expert``, -1 for a row without adapter (nothing added)."""
        L, E = self.a.shape[0], self.a.shape[1]
        a = self.a.view(L * E, *self.a.shape[2:])
        b = self.b.view(L * E, *self.b.shape[2:])
        lora_add(y, x, a, b, self.scale.view(L * E, -1), row_entries, self.starts, self.slices, batch_invariant)
