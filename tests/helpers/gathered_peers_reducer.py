"""A stand-in for the P2P reducer on CPU (gloo) tensor-parallel runs, so the fused all-reduce +
add + RMSNorm path runs end to end without GPUs: the ranks' partials are all-gathered over
gloo into this rank's "symmetric buffer" (one slot per rank, as the peers' pushes leave it) and
the fused Triton kernel (``TRITON_INTERPRET=1``) reduces them, its barrier off (every slot is
there before the launch; its own pushes into the peers' buffers land in scratch tensors).
Plain all-reduces still go to gloo. Tests patch ``megatron_async.llm.with_p2p_all_reduce``
with ``attach_gathered_peers_reducer``."""
from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.distributed as dist

from megatron_async.parallel.state import ParallelState


class GatheredPeersReducer:
    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.calls: Counter = Counter()
        self.max_bytes = 0

    def accepts(self, x: torch.Tensor) -> bool:
        return False  # plain all-reduces: gloo

    def fuses_norm(self, partial: torch.Tensor) -> bool:
        return partial.dim() == 2 and partial.is_contiguous() and self.fuses_rows(*partial.shape, partial.dtype)

    def fuses_rows(self, rows: int, hidden: int, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16)

    def add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     cast_before_weight: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        from megatron_async.kernels import triton_fused_all_reduce as fused

        if not fused.supported(partial, residual, weight, self.world):
            return None
        # Two buffer halves; a fresh call counter (0: the first half) every call. Slot r: rank r's partial.
        own = partial.new_empty((2, self.world, *partial.shape))
        dist.all_gather(list(own[0].unbind(0)), partial, group=self.group)
        buffers = [own if r == self.rank else torch.empty_like(own) for r in range(self.world)]
        table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        pads = torch.zeros(self.world, dtype=torch.int64)  # never read: no barrier
        self.calls["fused_norm"] += 1
        return fused.all_reduce_add_rms_norm(partial, residual, weight, eps, cast_before_weight, table, pads,
                                             torch.zeros(2, dtype=torch.int32), own[0].numel() * own.element_size(),
                                             self.rank, max_programs=4, barrier=False)

    def close(self) -> None:
        pass


def attach_gathered_peers_reducer(parallel: ParallelState, backend, max_bytes: int, device,
                                  fused_norm: bool = True) -> ParallelState:
    """``with_p2p_all_reduce``'s signature: the stand-in when TP is on and ``fused_norm``."""
    if parallel.tp_size == 1 or not fused_norm:
        return parallel
    return dataclasses.replace(parallel, tp_reducer=GatheredPeersReducer(parallel.tp_group))
