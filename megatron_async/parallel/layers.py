"""Megatron-style tensor-parallel building blocks as functions over plain weight tensors.

Column-parallel: the weight's output rows are split across ranks; the input is replicated
and the output stays sharded (no communication). Row-parallel: the weight's input columns
are split; each rank's partial product is summed over the group. At tp_size 1 every
function is exactly the single-GPU op, with no collective."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_async.kernels.linear import linear
from megatron_async.parallel.reduce import tp_sum
from megatron_async.parallel.state import tp_group, tp_rank, tp_size

Slicer = Callable[[torch.Tensor], torch.Tensor]


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({parts})")
    return total // parts


def rank_slice(dim: int, full: int) -> Slicer:
    """This rank's equal share, along ``dim``, of a full (unsharded) tensor of size ``full``
    there. A tensor of another size is returned whole, so the loader's shape check reports it."""
    size, rank = tp_size(), tp_rank()
    part = divide(full, size, f"dimension {dim}")
    return lambda t: t.narrow(dim, rank * part, part) if t.dim() > dim and t.shape[dim] == full else t


def shard_target(dest: torch.Tensor, dim: int, full: int) -> torch.Tensor | tuple[torch.Tensor, Slicer]:
    """A weight-loading target: ``dest`` as is at tp_size 1 (today's path), else ``dest``
    with the function that cuts this rank's share out of the full HF tensor."""
    return dest if tp_size() == 1 else (dest, rank_slice(dim, full))


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           batch_invariant: bool = False) -> torch.Tensor:
    """``weight``/``bias`` hold this rank's output rows; the result is this rank's output columns."""
    return linear(x, weight, bias, batch_invariant)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        batch_invariant: bool = False) -> torch.Tensor:
    """``x``: this rank's input columns; ``weight``: the matching columns; ``bias``: full,
    added once after the sum."""
    if tp_size() == 1:
        return linear(x, weight, bias, batch_invariant)
    out = tp_sum(linear(x, weight, None, batch_invariant), tp_group(), tp_size(), batch_invariant)
    return out if bias is None else out + bias


def vocab_parallel_embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight``: this rank's contiguous vocabulary rows. Ids owned by other ranks look up
    zeros here; the all-reduce fills in every row from its owner."""
    if tp_size() == 1:
        return F.embedding(input_ids, weight)
    start = tp_rank() * weight.shape[0]
    local = input_ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out.masked_fill_(outside.unsqueeze(-1), 0.0)
    dist.all_reduce(out, group=tp_group())
    return out


def parallel_lm_head(hidden: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """Logits of this rank's vocabulary rows, gathered so that every rank holds the full
    [N, vocab] float32 logits (and therefore samples the same tokens)."""
    local = linear(hidden, weight, None, batch_invariant)  # in the model dtype, as HF does
    if tp_size() == 1:
        return local.float()
    parts = [torch.empty_like(local) for _ in range(tp_size())]
    dist.all_gather(parts, local.contiguous(), group=tp_group())
    return torch.cat(parts, dim=-1).float()
