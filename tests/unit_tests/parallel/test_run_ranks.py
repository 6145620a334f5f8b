"""run_ranks' deadline: a hung rank is killed, the error names it and the rank that failed
first, and the hung rank's Python stack reaches stderr (where it waits: the collective)."""
from __future__ import annotations

import time

import pytest

from tests.helpers.multiprocess import run_ranks


def _wait_in_a_named_collective():
    time.sleep(600)


def _hang_or_fail(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError("rank 0 broke first")
    _wait_in_a_named_collective()


def _nothing(rank: int, world: int) -> None:
    return None


def test_a_hung_rank_times_out_with_its_stack_and_the_first_failure(capfd):
    # The fork server up first (it imports torch: seconds on a busy box), so that the hung rank
    # sleeps well before its stack is dumped, 2 s ahead of the deadline.
    run_ranks(_nothing, 2)
    with pytest.raises(TimeoutError) as err:
        run_ranks(_hang_or_fail, 2, timeout_s=4)
    msg = str(err.value)
    assert "ranks [1] still running after 4 s" in msg
    assert "rank 0 failed first" in msg and "ValueError: rank 0 broke first" in msg
    assert "_wait_in_a_named_collective" in capfd.readouterr().err
