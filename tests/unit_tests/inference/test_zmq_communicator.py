"""ZMQCommunicator across 2-3 spawned processes joined through a store; every receive is bounded."""
import re
import time

import pytest

from megatron_async.inference.communication.zmq_communicator import CommunicatorError, ZMQCommunicator
from tests.helpers.communicators import join
from tests.helpers.multiprocess import free_port, run_ranks


def _collectives(rank: int, world: int, port: int):
    with join(rank, world, port, timeout_s=10) as comm:
        got = [comm.broadcast_object({"step": 1, "reqs": [[1, 2, 3]]} if rank == 0 else "ignored")]
        got.append(comm.all_reduce_max([rank, 10 - rank, 0]))
        comm.barrier()
        got.append(comm.broadcast_object(None if rank else ("done", rank)))
        got.append(comm.all_reduce_max([]))
        return got


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_agree_on_every_rank(world):
    results = run_ranks(_collectives, world, free_port(), timeout_s=30)
    expected = [{"step": 1, "reqs": [[1, 2, 3]]}, [world - 1, 10, 0], ["done", 0], []]
    assert results[1:] == [expected] * (world - 1)  # (a tuple travels as a list)
    assert results[0][2] == ("done", 0)


def _diverge(rank: int, world: int, port: int):
    with join(rank, world, port, timeout_s=5) as comm:
        if rank == 0:
            comm.broadcast_object("x")
            time.sleep(1.0)  # keep the socket open until rank 1 has read it
            return "sent"
        try:
            comm.all_reduce_max([1])
        except CommunicatorError as e:
            return str(e)
        return "no error"


def test_ranks_calling_different_collectives_fail_loudly():
    _, err = run_ranks(_diverge, 2, free_port(), timeout_s=30)
    assert "diverged" in err and "broadcast" in err


def _silent_root(rank: int, world: int, port: int):
    with join(rank, world, port, timeout_s=0.5) as comm:
        if rank == 0:
            time.sleep(1.5)
            return None
        t0 = time.monotonic()
        try:
            comm.broadcast_object()
        except CommunicatorError as e:
            return str(e), time.monotonic() - t0
        return "no error", 0.0


def test_missing_message_times_out_instead_of_hanging():
    _, (err, waited) = run_ranks(_silent_root, 2, free_port(), timeout_s=30)
    assert "no message within 500 ms" in err
    assert 0.4 < waited < 1.4


def _late_joiner(rank: int, world: int, port: int):
    if rank == 1:
        time.sleep(1.5)  # a slow start (imports, model build) longer than the per-message timeout
    with join(rank, world, port, timeout_s=0.5) as comm:
        return comm.all_reduce_max([rank + 1])


def test_joining_waits_longer_than_the_message_timeout():
    assert run_ranks(_late_joiner, 2, free_port(), timeout_s=30) == [[2], [2]]


def test_world_of_one_needs_no_sockets():
    comm = ZMQCommunicator(0, 1)  # no store, no socket
    assert comm.broadcast_object([5]) == [5]
    assert comm.all_reduce_max([3, 4]) == [3, 4]
    comm.barrier()
    comm.close()


def test_rank_outside_world_is_rejected():
    with pytest.raises(ValueError, match="outside world"):
        ZMQCommunicator(2, 2)



def _peer_dies(rank: int, world: int, port: int):
    """Rank 1 dies (its socket drops without a word) while rank 0 waits in a collective with a
    60 s timeout: rank 0 must fail at once, naming the lost connection."""
    import os

    comm = join(rank, world, port, timeout_s=60)
    if rank == 1:
        time.sleep(0.5)
        os._exit(7)
    t0 = time.monotonic()
    try:
        comm.all_reduce_max([1])
    except CommunicatorError as e:
        raise CommunicatorError(f"{e} [waited={time.monotonic() - t0:.2f}]") from None
    finally:
        comm.close()


def test_dead_peer_fails_the_waiting_rank_at_once():
    with pytest.raises(RuntimeError) as failed:
        run_ranks(_peer_dies, 2, free_port(), timeout_s=30)
    report = str(failed.value)
    assert "rank 1 failed:\nexited with code 7 without a result" in report
    assert "rank 0: lost the connection to a peer" in report and "all_reduce_max #" in report
    waited = float(re.search(r"\[waited=([0-9.]+)\]", report).group(1))
    assert waited < 5.0  # not the 60 s timeout


def _rendezvous(rank: int, world: int, port: int, force_tcp: bool):
    """Through a store, as engines join: on one host, rank 0 binds only an ipc:// endpoint in a
    private directory (no TCP port), and removes the directory at close."""
    import os

    comm = join(rank, world, port, timeout_s=10, force_tcp=force_tcp)
    tr = comm.transport
    got = comm.all_reduce_max([rank])
    directory = tr.plan.directory
    private = directory is not None and os.stat(directory).st_mode & 0o777 == 0o700
    comm.barrier()
    comm.close()
    return tr.endpoints, got, directory, private, directory is not None and os.path.exists(directory)


def test_ranks_on_one_host_bind_only_a_private_unix_socket_removed_at_close():
    results = run_ranks(_rendezvous, 3, free_port(), False, timeout_s=30)
    assert [r[1] for r in results] == [[2]] * 3
    assert all(len(r[0]) == 1 and r[0][0].startswith("ipc://") for r in results), results  # no TCP bound
    assert results[0][3] and results[0][4] is False  # 0700, and close() removed it


def test_ranks_spanning_hosts_listen_on_tcp_towards_the_master():
    results = run_ranks(_rendezvous, 2, free_port(), True, timeout_s=30)
    bound, joined = results[0][0], results[1][0]
    assert [e.split(":")[0] for e in bound] == ["ipc", "tcp"] and joined[0].startswith("tcp://")
    assert not bound[1].startswith("tcp://0.0.0.0") and joined == [bound[1]]
