"""The tensor-parallel collectives of the forward pass, in one place: a faster small-message
all-reduce (CUDA P2P / symmetric memory) or graph-capture handling plugs in here, with NCCL /
gloo as the fallback. Each is the identity at tp_size 1 (no collective at all).

Batch-invariant mode sums differently: NCCL picks ring / tree and chunking from the message
size, so the order in which ranks' partials are added (and with it the bf16 bits) can change
with the number of tokens in the step; there the partials are all-gathered and added locally
in rank order in float32, rounded once. Same TP size only: another TP size cuts K
differently, so no promise across sizes."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_async.parallel.state import ParallelState


def tp_all_reduce(x: torch.Tensor, parallel: ParallelState, batch_invariant: bool = False) -> torch.Tensor:
    """Sum ``x`` over the TP group (in place by default; a new tensor, summed in rank order,
    when ``batch_invariant``)."""
    if parallel.tp_size == 1:
        return x
    if not batch_invariant:
        dist.all_reduce(x, group=parallel.tp_group)
        return x
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=parallel.tp_group)
    total = parts[0].float()
    for p in parts[1:]:
        total += p.float()
    return total.to(x.dtype)


def tp_all_gather_last_dim(x: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim, in rank order."""
    if parallel.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=parallel.tp_group)
    return torch.cat(parts, dim=-1)
