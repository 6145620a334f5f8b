"""The collectives of the forward pass, in one place: tensor-parallel all-reduce / all-gather
and the expert-parallel token exchange of MoE layers. Small TP all-reduces take the P2P path
(``parallel.tp_reducer``, ``p2p_all_reduce.py``) when the group has one, NCCL / gloo otherwise.
Each is the identity at size 1 (no collective at all).

The default EP exchange (all-gather / reduce-scatter) needs equal shapes on every rank: each
rank pads its tokens to the count the engines agreed on the CPU (``StepInputs.ep_num_tokens``),
so no collective carries a size and no rank waits on a device value to size a buffer. The
all-to-all exchange sends each token only to the ranks of its experts; its split sizes are
device values read on the host (one sync per layer), so it is an eager-only option.

Batch-invariant mode sums differently: NCCL picks ring / tree and chunking from the message
size, so the order in which ranks' partials are added (and with it the bf16 bits) can change
with the number of tokens in the step; there the partials are all-gathered and added locally
in rank order in float32, rounded once. Same TP size only: another TP size cuts K
differently, so no promise across sizes.

CUDA-graph safe on NCCL (TP collectives and the default EP exchange): each is one in-place /
into-tensor collective on tensors the graph's pool owns, with no host read-back and no
Python-side size decisions; ProcessGroupNCCL records them into the capturing stream. The NCCL
communicator must exist before capture: the eager steps and the capture's warm-up iterations
run the same collectives first."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_async.kernels.deferred_sum import DeferredSum
from megatron_async.parallel.state import ParallelState

# torch >= 2.12 renames the one-tensor all-gather (the old name warns there; older torch lacks the new one)
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_all_reduce(x: torch.Tensor, parallel: ParallelState, batch_invariant: bool = False) -> torch.Tensor:
    """Sum ``x`` over the TP group (in place by default; a new tensor, summed in rank order,
    when ``batch_invariant``)."""
    if parallel.tp_size == 1:
        return x
    if not batch_invariant:
        reducer = parallel.tp_reducer
        if reducer is not None and reducer.accepts(x):
            return reducer.all_reduce(x)
        dist.all_reduce(x, group=parallel.tp_group)
        return x
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=parallel.tp_group)
    total = parts[0].float()
    for p in parts[1:]:
        total += p.float()
    return total.to(x.dtype)


@dataclass(frozen=True)
class PendingSum(DeferredSum):
    """A row-parallel layer's partial product whose sum over the TP group is left to the next
    block's norm (``RMSNorm.add_and_norm``), which sums, adds the residual and normalises in
    one kernel (``tp_reducer.add_rms_norm``) or, when that kernel does not take its tensors,
    calls ``reduce`` first. ``partial`` may itself be this rank's K-split partials
    (``triton_split_linear.PendingSplitSum``), which that kernel sums before the exchange."""

    partial: torch.Tensor | DeferredSum
    parallel: ParallelState

    def reduce(self) -> torch.Tensor:
        local = self.partial.reduce() if isinstance(self.partial, DeferredSum) else self.partial
        return tp_all_reduce(local, self.parallel)

    def add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     cast_before_weight: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        partial = self.partial
        if isinstance(partial, DeferredSum):  # a PendingSplitSum (RowParallelLinear hands no other kind)
            if partial.bias is not None or partial.dtype != residual.dtype:
                return None
            partial = partial.parts
        return self.parallel.tp_reducer.add_rms_norm(partial, residual, weight, eps, cast_before_weight)


def tp_all_gather_last_dim(x: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim, in rank order."""
    if parallel.tp_size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((parallel.tp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_into_tensor(out, x, group=parallel.tp_group)
    return torch.cat(out.chunk(parallel.tp_size, dim=0), dim=-1)


def ep_all_gather(x: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """[n, ...] on every EP rank (the same n) -> [ep_size * n, ...], rank r's rows at r * n."""
    if parallel.ep_size == 1:
        return x
    x = x.contiguous()
    p2p = parallel.ep_exchanger
    if p2p is not None and p2p.accepts(x, gather=True):
        return p2p.all_gather(x)
    out = torch.empty((parallel.ep_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if x.is_cuda:
        dist.all_gather_into_tensor(out, x, group=parallel.ep_group)
    else:  # gloo: into row blocks of ``out`` (contiguous views)
        dist.all_gather(list(out.chunk(parallel.ep_size)), x, group=parallel.ep_group)
    return out


def ep_reduce_scatter(x: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """[ep_size * n, ...] partial sums on every EP rank -> this rank's [n, ...] block of their sum."""
    if parallel.ep_size == 1:
        return x
    x = x.contiguous()
    n = x.shape[0] // parallel.ep_size
    p2p = parallel.ep_exchanger
    if p2p is not None and p2p.accepts(x, gather=False):
        return p2p.reduce_scatter(x)
    if x.is_cuda:
        out = torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=parallel.ep_group)
        return out
    dist.all_reduce(x, group=parallel.ep_group)  # gloo has no reduce-scatter
    return x[parallel.ep_rank * n:(parallel.ep_rank + 1) * n]


def ep_all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                  parallel: ParallelState) -> torch.Tensor:
    """Rows [sum(send_counts), ...] in destination-rank order -> the rows the other ranks sent
    here [sum(recv_counts), ...], in source-rank order."""
    out = torch.empty((sum(recv_counts), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=parallel.ep_group)
    return out


def ep_exchange_counts(send_counts: torch.Tensor, parallel: ParallelState) -> list[int]:
    """Each rank's row counts for every rank ([ep_size] int64) -> the counts each rank sends
    here, on the host: a device-to-host sync (the all-to-all exchange is eager only)."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=parallel.ep_group)
    return recv.tolist()
