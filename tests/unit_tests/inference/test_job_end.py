"""Rank 0 announces the end of the job (``announce_end``): a rank waiting for it in a round (shared
memory or ZMQ) raises ``LeaderEnded`` with rank 0's status, one done with its rounds reads it in
``wait_for_end``; a rank 0 that dies unannounced is still a ``CommunicatorError``."""
import os
import re
import time

import pytest

from megatron_async.inference.communication.zmq_transport import LeaderEnded
from tests.helpers.communicators import join
from tests.helpers.multiprocess import free_port, run_ranks

TIMEOUT_S = 60.0  # far past what an announcement takes: an end by timeout would fail the checks


def _ends_mid_round(rank: int, world: int, port: int, shared_memory: bool):
    with join(rank, world, port, timeout_s=TIMEOUT_S, shared_memory=shared_memory) as comm:
        comm.exchange([rank])
        if rank == 0:
            comm.announce_end(3)
            return comm.exchange_path
        t0 = time.monotonic()
        try:
            comm.exchange([rank])  # a round rank 0 never starts
        except LeaderEnded as e:
            return e.status, str(e), time.monotonic() - t0
        return "no end"


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_rank_waiting_in_a_round_ends_with_rank_0s_status(shared_memory):
    path, *others = run_ranks(_ends_mid_round, 3, free_port(), shared_memory, timeout_s=TIMEOUT_S)
    assert path == ("shared_memory" if shared_memory else "zmq")
    for rank, (status, message, waited) in enumerate(others, start=1):
        assert status == 3 and re.match(rf"rank {rank}: rank 0 ended the job \(exit status 3\) in exchange #\d+", message)
        assert waited < TIMEOUT_S / 2


def _waits_for_end(rank: int, world: int, port: int, status: int):
    with join(rank, world, port, timeout_s=TIMEOUT_S) as comm:
        comm.exchange([rank])
        if rank == 0:
            comm.announce_end(status)
            return status
        return comm.wait_for_end()


@pytest.mark.parametrize("status", [0, 1])
def test_a_rank_done_with_its_rounds_reads_rank_0s_status(status):
    assert run_ranks(_waits_for_end, 2, free_port(), status, timeout_s=TIMEOUT_S) == [status, status]


def _root_dies(rank: int, world: int, port: int, shared_memory: bool, then_wait: bool):
    with join(rank, world, port, timeout_s=TIMEOUT_S, shared_memory=shared_memory) as comm:
        comm.exchange([rank])
        if rank == 0:
            os._exit(9)  # without a word
        if then_wait:
            comm.wait_for_end()
        else:
            comm.exchange([rank])


@pytest.mark.parametrize("shared_memory, then_wait", [(True, False), (False, False), (False, True)])
def test_a_rank_0_that_dies_unannounced_is_a_lost_connection(shared_memory, then_wait):
    with pytest.raises(RuntimeError) as failed:
        run_ranks(_root_dies, 2, free_port(), shared_memory, then_wait, timeout_s=TIMEOUT_S)
    report = str(failed.value)
    assert "rank 0 failed:\nexited with code 9" in report
    assert "CommunicatorError: rank 1: lost the connection to rank 0" in report
