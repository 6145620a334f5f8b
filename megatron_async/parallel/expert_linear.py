"""Expert-parallel linear layers: the weights of a MoE layer's routed experts as one
[num_local_experts, out, in] tensor holding the experts of ``parallel.ep_rank`` (a contiguous
range), each expert's matrix also split over the TP group like a column / row-parallel layer.

They own their weight loading: ``weight_loader(param, loaded, shard_id=(expert, part))`` takes
one FULL Hugging Face expert tensor (e.g. ``experts.5.gate_proj.weight``), skips experts of
other EP ranks and cuts this rank's TP slice through ``Sharding``. ``param.hf_names`` lists
every HF tensor of the parameter (relative to the module's parent), so checkpoint loading
(``models/weight_loading.py``) needs no expert-specific code. The layers hold weights only: the
grouped GEMMs run in ``kernels/moe_experts.py`` over tokens exchanged across the EP group."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_async.parallel.linear import ParallelLinear
from megatron_async.parallel.sharding import Destination, Sharding, ShardId
from megatron_async.parallel.state import ParallelState


@dataclass(frozen=True)
class ExpertSharding:
    """How a [num_local_experts, out, in] parameter is filled from per-expert HF tensors."""

    inner: Sharding
    """The TP cut of one expert's [out, in] matrix (dims relative to that matrix)."""
    num_experts: int
    first_expert: int
    num_local: int

    def _expert(self, shard_id: ShardId) -> tuple[int, ShardId]:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2):
            raise ValueError(f"expert weights load one expert at a time (shard_id=(expert, part)), got {shard_id!r}")
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside [0, {self.num_experts})")
        return expert, part

    def full_shape(self, local_shape: tuple[int, ...], shard_id: ShardId = None) -> tuple[int, ...]:
        _, part = self._expert(shard_id)
        return self.inner.full_shape(tuple(local_shape[1:]), part)

    def is_local(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local

    def destinations(self, target: torch.Tensor, shard_id: ShardId = None) -> list[Destination]:
        """This rank's boxes of expert ``shard_id[0]``'s full HF tensor; [] for another EP rank's expert."""
        expert, part = self._expert(shard_id)
        if not self.is_local(expert):
            return []
        return self.inner.destinations(target[expert - self.first_expert], part)

    @torch.no_grad()
    def load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        expected = self.full_shape(tuple(param.shape), shard_id)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {expected}")
        for dest in self.destinations(param.data, shard_id):  # other EP ranks' experts: checked, not kept
            dest.view.copy_(loaded[tuple(slice(a, b) for a, b in zip(dest.box.lo, dest.box.hi))])


class ExpertParallelLinear(ParallelLinear):
    """``weight`` [num_local_experts, out_local, in_local]; no bias (no supported family has one).
    FP8: e4m3 weights and ``weight_scale_inv`` [num_local_experts, scale rows, in_local / 128]."""

    def __init__(self, num_experts: int, inner: Sharding, local_shape: tuple[int, int], hf_parts: tuple[str, ...],
                 part_ids: tuple[ShardId, ...], parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device | str, fp8: bool = False):
        self.num_local_experts = parallel.ep_divide(num_experts, "the number of routed experts")
        self.first_expert = parallel.ep_rank * self.num_local_experts
        sharding = ExpertSharding(inner, num_experts, self.first_expert, self.num_local_experts)
        loads = tuple((self.first_expert, part) for part in part_ids) if fp8 else None
        super().__init__((self.num_local_experts, *local_shape), sharding, None, sharding, parallel, dtype, device,
                         loads)
        # every HF tensor of this parameter, e.g. ("5.gate_proj.weight", (5, 0)): all experts are
        # named (other ranks' are read and skipped) so a missing one is still reported
        for param, suffix in ((self.weight, "weight"), (self.weight_scale_inv, "weight_scale_inv")):
            if param is not None:
                param.hf_names = tuple((f"{e}.{name}.{suffix}", (e, part)) for e in range(num_experts)
                                       for name, part in zip(hf_parts, part_ids))


class ExpertColumnParallelLinear(ExpertParallelLinear):
    """Experts' input projections: parts (gate, up) stacked along the output features, each
    split over TP, so this rank holds [gate_local | up_local] rows per expert."""

    def __init__(self, num_experts: int, in_features: int, output_sizes: list[int], hf_parts: tuple[str, ...],
                 parallel: ParallelState, dtype: torch.dtype, device: torch.device | str, fp8: bool = False):
        ids = tuple(range(len(output_sizes))) if len(output_sizes) > 1 else (None,)
        inner = Sharding.split(0, tuple(output_sizes), parallel, "moe_intermediate_size",
                               ids if len(output_sizes) > 1 else ())
        self.output_sizes = [s // parallel.tp_size for s in output_sizes]
        super().__init__(num_experts, inner, (sum(self.output_sizes), in_features), hf_parts, ids,
                         parallel, dtype, device, fp8)


class ExpertRowParallelLinear(ExpertParallelLinear):
    """Experts' output projections: input features split over TP (the caller sums the partial
    outputs over the TP group after the EP exchange)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, hf_part: str,
                 parallel: ParallelState, dtype: torch.dtype, device: torch.device | str, fp8: bool = False):
        inner = Sharding.split(1, in_features, parallel, "moe_intermediate_size")
        super().__init__(num_experts, inner, (out_features, in_features // parallel.tp_size), (hf_part,), (None,),
                         parallel, dtype, device, fp8)
