"""The TP sum of batch-invariant mode (``tp_all_reduce(..., batch_invariant=True)``): all-gather,
then a float32 sum in rank order, rounded once. 3 gloo ranks on CPU: every rank gets exactly
that sum, whatever the number of rows."""
from __future__ import annotations

import torch

from tests.helpers.multiprocess import run_ranks


def _partial(rank: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(64, 48, generator=g) * 10 ** rank).to(torch.bfloat16)[:rows]


def _worker(rank: int, world: int) -> list[tuple[str, list]]:
    import torch.distributed as dist

    from megatron_async.parallel.communication import tp_all_reduce
    from megatron_async.parallel.state import ParallelState

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel = ParallelState(tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD)
        outs = [tp_all_reduce(_partial(rank, rows), parallel, batch_invariant=True) for rows in (1, 7, 64)]
        return [(str(o.dtype), o.float().tolist()) for o in outs]  # bf16 -> float is exact
    finally:
        dist.destroy_process_group()


def test_invariant_tp_sum_is_rank_ordered_and_row_independent():
    results = run_ranks(_worker, 3, timeout_s=60)
    parts = [_partial(r, 64).float() for r in range(3)]
    expected = ((parts[0] + parts[1]) + parts[2]).to(torch.bfloat16)
    for per_rank in results:
        for (dtype, out), rows in zip(per_rank, (1, 7, 64)):
            assert dtype == "torch.bfloat16" and out == expected[:rows].float().tolist()
