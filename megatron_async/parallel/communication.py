"""The tensor-parallel collectives of the forward pass, in one place: a faster small-message
all-reduce (CUDA P2P / symmetric memory) plugs in here, with NCCL / gloo as the fallback. Each
is the identity at tp_size 1 (no collective at all).

CUDA-graph safe on NCCL: both are single in-place / into-tensor collectives on tensors the
graph's pool owns, with no host read-back and no Python-side size decisions; ProcessGroupNCCL
records them into the capturing stream (it keeps captured work out of its watchdog). The NCCL
communicator must exist before capture: the eager steps and the capture's warm-up iterations
run the same collectives first."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_async.parallel.state import ParallelState

# torch >= 2.12 renames the one-tensor all-gather (the old name warns there; older torch lacks the new one)
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_all_reduce(x: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place."""
    if parallel.tp_size > 1:
        dist.all_reduce(x, group=parallel.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim, in rank order."""
    if parallel.tp_size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((parallel.tp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_into_tensor(out, x, group=parallel.tp_group)
    return torch.cat(out.chunk(parallel.tp_size, dim=0), dim=-1)
