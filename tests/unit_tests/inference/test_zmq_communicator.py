"""ZMQCommunicator across 2-3 spawned processes on loopback; every receive is bounded."""
import re
import time

import pytest

from megatron_async.inference.communication.zmq_communicator import CommunicatorError, ZMQCommunicator
from tests.helpers.multiprocess import free_port, run_ranks


def _collectives(rank: int, world: int, port: int):
    with ZMQCommunicator(rank, world, "127.0.0.1", port, timeout_s=10) as comm:
        got = [comm.broadcast_object({"step": 1, "reqs": [[1, 2, 3]]} if rank == 0 else "ignored")]
        got.append(comm.all_reduce_max([rank, 10 - rank, 0]))
        comm.barrier()
        got.append(comm.broadcast_object(None if rank else ("done", rank)))
        got.append(comm.all_reduce_max([]))
        return got


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_agree_on_every_rank(world):
    results = run_ranks(_collectives, world, free_port(), timeout_s=30)
    expected = [{"step": 1, "reqs": [[1, 2, 3]]}, [world - 1, 10, 0], ("done", 0), []]
    assert results == [expected] * world


def _diverge(rank: int, world: int, port: int):
    with ZMQCommunicator(rank, world, "127.0.0.1", port, timeout_s=5) as comm:
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
    with ZMQCommunicator(rank, world, "127.0.0.1", port, timeout_s=0.5) as comm:
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
    with ZMQCommunicator(rank, world, "127.0.0.1", port, timeout_s=0.5) as comm:
        return comm.all_reduce_max([rank + 1])


def test_joining_waits_longer_than_the_message_timeout():
    assert run_ranks(_late_joiner, 2, free_port(), timeout_s=30) == [[2], [2]]


def test_world_of_one_needs_no_sockets():
    comm = ZMQCommunicator(0, 1, "127.0.0.1", 1)  # port 1 would fail to bind
    assert comm.broadcast_object([5]) == [5]
    assert comm.all_reduce_max([3, 4]) == [3, 4]
    comm.barrier()
    comm.close()


def test_rank_outside_world_is_rejected():
    with pytest.raises(ValueError, match="outside world"):
        ZMQCommunicator(2, 2, "127.0.0.1", 1)



def _peer_dies(rank: int, world: int, port: int):
    """Rank 1 dies (its socket drops without a word) while rank 0 waits in a collective with a
    60 s timeout: rank 0 must fail at once, naming the lost connection."""
    import os

    comm = ZMQCommunicator(rank, world, "127.0.0.1", port, timeout_s=60)
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


def _rendezvous(rank: int, world: int, port: int):
    """Through a store, as engines join: the peers on rank 0's host connect over its Unix socket."""
    from datetime import timedelta

    import torch.distributed as dist
    import zmq

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=20))
    comm = ZMQCommunicator.from_rendezvous(store, rank, world, timeout_s=10)
    endpoint = comm.transport.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    got = comm.all_reduce_max([rank])
    path = comm.transport.ipc_path
    comm.barrier()
    comm.close()
    return endpoint, got, path, path is not None and __import__("os").path.exists(path)


def test_ranks_on_one_host_use_the_unix_socket_and_it_is_removed():
    results = run_ranks(_rendezvous, 3, free_port(), timeout_s=30)
    assert [r[1] for r in results] == [[2]] * 3
    assert all(r[0].startswith("ipc://") for r in results[1:]), results  # the peers connected over IPC
    assert results[0][2] is not None and results[0][3] is False  # rank 0 bound it, and close() removed it


def test_endpoint_choice():
    import socket
    import tempfile

    from megatron_async.inference.communication.zmq_transport import pick_endpoint

    with tempfile.NamedTemporaryFile() as f:
        here = socket.gethostname()
        assert pick_endpoint(f"tcp://10.0.0.1:5 ipc://{f.name} {here}") == f"ipc://{f.name}"
        assert pick_endpoint(f"tcp://10.0.0.1:5 ipc://{f.name} other-host") == "tcp://10.0.0.1:5"
    assert pick_endpoint(f"tcp://10.0.0.1:5 ipc://{f.name} {here}") == "tcp://10.0.0.1:5"  # not visible here
