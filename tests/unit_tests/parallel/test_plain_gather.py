"""``all_gather_plain``: every rank of a gloo group gets every rank's plain value, in rank order,
whatever their encoded lengths; ``group_problem`` (the P2P set-up's vote) through it names the
first rank with a problem on every rank. 3 ranks on CPU."""
from __future__ import annotations

from tests.helpers.multiprocess import run_ranks


def _value(rank: int):
    return [rank, "h" * (1 + 40 * rank), None if rank == 1 else {"k": [rank] * rank}, b"\x80\x04." * rank]


def _worker(rank: int, world: int) -> tuple[list, list]:
    import torch
    import torch.distributed as dist

    from megatron_async.parallel.p2p_checks import group_problem
    from megatron_async.parallel.plain_gather import all_gather_plain

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cpu = torch.device("cpu")
        return (all_gather_plain(_value(rank), dist.group.WORLD, cpu),
                [group_problem(dist.group.WORLD, cpu, problem) for problem in (None, "no NVLink" if rank else None)])
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_every_ranks_value_and_the_same_vote():
    for gathered, votes in run_ranks(_worker, 3, timeout_s=60):
        assert gathered == [_value(r) for r in range(3)]
        assert votes == [None, "rank 1: no NVLink"]
