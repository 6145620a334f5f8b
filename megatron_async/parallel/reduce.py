"""The tensor-parallel sum of row-parallel partial results, in one place.

Default: ``dist.all_reduce`` (NCCL picks ring/tree and chunking from the message size, so
the order in which ranks' partials are added, and with it the bf16 bits, can change with
the number of tokens in the step). Batch-invariant mode: all-gather the partials and add
them locally in rank order in float32, rounding once: every element's sum is the same
function of its partials whatever the step's size. Same TP size only: a different TP size
cuts K differently, so no promise across sizes."""
from __future__ import annotations

import torch
import torch.distributed as dist


def tp_sum(partial: torch.Tensor, group: dist.ProcessGroup | None, world: int,
           batch_invariant: bool = False) -> torch.Tensor:
    """Sum of ``partial`` over the ``world`` ranks of ``group``; may reduce in place."""
    if world == 1:
        return partial
    if not batch_invariant:
        dist.all_reduce(partial, group=group)
        return partial
    parts = [torch.empty_like(partial) for _ in range(world)]
    dist.all_gather(parts, partial.contiguous(), group=group)
    total = parts[0].float()
    for p in parts[1:]:
        total += p.float()
    return total.to(partial.dtype)
