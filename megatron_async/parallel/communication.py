"""The tensor-parallel collectives of the forward pass, in one place: a faster small-message
all-reduce (CUDA P2P / symmetric memory) or graph-capture handling plugs in here, with NCCL /
gloo as the fallback. Each is the identity at tp_size 1 (no collective at all)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_async.parallel.state import ParallelState


def tp_all_reduce(x: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place."""
    if parallel.tp_size > 1:
        dist.all_reduce(x, group=parallel.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim, in rank order."""
    if parallel.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=parallel.tp_group)
    return torch.cat(parts, dim=-1)
