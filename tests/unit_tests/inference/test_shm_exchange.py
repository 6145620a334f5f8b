"""The shared-memory exchange (ranks on one host) against the ZMQ one, on spawned ranks: same
results for random values, payloads / uploads arrive only when sent, a dead or silent rank ends
in a CommunicatorError within the timeout, and nothing is left in /dev/shm."""
import glob
import os
import random
import re
import time

import pytest

from megatron_async.inference.communication.shm_slots import supported
from megatron_async.inference.communication.zmq_communicator import CommunicatorError
from tests.helpers.communicators import join
from tests.helpers.multiprocess import free_port, run_ranks

pytestmark = pytest.mark.skipif(not supported(), reason="shared slots need x86 store ordering")


BIG = (1 << 20) + 1


def _both_paths(rank: int, world: int, ports: tuple[int, int], rounds: int):
    shm = join(rank, world, ports[0], timeout_s=20)
    zmq_ = join(rank, world, ports[1], timeout_s=20, shared_memory=False)
    try:
        inputs = []
        for i in range(rounds):
            rng = random.Random(1000 * i + rank)  # this rank's draw; the same for both paths
            n = 3 + i % 4  # lengths change between rounds (same on every rank within one)
            values = [rng.randint(-2**62, 2**62) for _ in range(n)]
            # some too big for the shared byte area (1 MiB a round): those go over ZMQ
            big = b"x" * BIG if i % 10 == 3 else b""
            upload = {"rank": rank, "i": i, "big": big} if rank and rng.random() < 0.7 else None
            payload = [i, "news", big] if rank == 0 and rng.random() < 0.5 else None
            inputs.append((values, upload, payload))
        # back to back on each path (ranks run up to a round ahead of each other on shared memory),
        # with a ZMQ collective in between, as the engines mix them; rank 0 takes the uploads
        # every third round (the others carry over)
        a, b = [], []
        for got, comm in ((a, shm), (b, zmq_)):
            for i, x in enumerate(inputs):
                if i % 25 == 24:
                    comm.barrier()
                result, payload = comm.exchange(*x)
                got.append((result, payload, comm.take_uploads() if rank == 0 and i % 3 == 2 else None))
        return shm.exchange_path, zmq_.exchange_path, [(x, y, *z) for x, y, z in zip(a, b, inputs)]
    finally:
        shm.close()
        zmq_.close()


@pytest.mark.parametrize("world", [2, 4])
def test_shared_memory_exchange_equals_zmq(world):
    before = set(glob.glob("/dev/shm/ma-consensus-*"))
    results = run_ranks(_both_paths, world, (free_port(), free_port()), 60, timeout_s=120)
    assert [r[:2] for r in results] == [("shared_memory", "zmq")] * world
    untaken = []
    for i in range(60):
        per_rank = [r[2][i] for r in results]
        expected_max = [max(col) for col in zip(*(p[2] for p in per_rank))]
        untaken += [p[3] for p in per_rank[1:] if p[3] is not None]
        payload = per_rank[0][4]
        for rank, (shm, zmq_, *_rest) in enumerate(per_rank):
            assert shm == zmq_, (i, rank)  # the two paths agree exactly
            assert shm[0] == expected_max and shm[1] == payload
            if rank == 0 and i % 3 == 2:  # every upload since the last take, by round then rank
                assert shm[2] == untaken, i
                untaken = []
            else:
                assert shm[2] is None
    sent = [(rank, len(upload["big"])) for rank, r in enumerate(results) for *_, upload, _ in r[2] if upload]
    sent += [(0, len(payload[2])) for *_, payload in results[0][2] if payload]
    assert {(rank, size) for rank in range(world) for size in (0, BIG)} <= set(sent)  # every rank, both ways
    assert set(glob.glob("/dev/shm/ma-consensus-*")) <= before  # unlinked once every rank mapped it


def _one_host_opt_out(rank: int, world: int, port: int):
    with join(rank, world, port, timeout_s=20, shared_memory=rank != 1) as comm:
        return comm.exchange_path, comm.exchange([rank], None, "p" if rank == 0 else None)


def test_one_rank_opting_out_puts_every_rank_on_zmq():
    results = run_ranks(_one_host_opt_out, 3, free_port(), timeout_s=60)
    assert results == [("zmq", ([2], "p"))] * 3


def _killed(rank: int, world: int, port: int):
    """The last rank dies between rounds while the others wait with a 60 s timeout."""
    comm = join(rank, world, port, timeout_s=60)
    assert comm.exchange_path == "shared_memory"
    comm.exchange([rank])
    if rank == world - 1:
        time.sleep(0.3)
        os._exit(7)
    t0 = time.monotonic()
    try:
        comm.exchange([rank])
    except CommunicatorError as e:
        raise CommunicatorError(f"{e} [waited={time.monotonic() - t0:.2f}]") from None
    finally:
        comm.close()


@pytest.mark.parametrize("world", [2, 3])
def test_killed_rank_fails_the_others_at_once(world):
    with pytest.raises(RuntimeError) as failed:
        run_ranks(_killed, world, free_port(), timeout_s=40)
    report = str(failed.value)
    assert f"rank {world - 1} failed:\nexited with code 7 without a result" in report
    assert "rank 0: lost the connection to a peer" in report  # rank 0 hears of every peer
    if world == 3:  # rank 1 hears nothing over ZMQ: rank 0 poisoned the slots
        assert "rank 1: rank 0 gave up in shared-memory round" in report
    waits = [float(w) for w in re.findall(r"\[waited=([0-9.]+)\]", report)]
    assert len(waits) == world - 1 and max(waits) < 5.0  # not the 60 s timeout


def _silent(rank: int, world: int, port: int):
    with join(rank, world, port, timeout_s=0.5) as comm:
        if rank == 1:
            time.sleep(1.5)
            return None
        t0 = time.monotonic()
        try:
            comm.exchange([1])
        except CommunicatorError as e:
            return str(e), time.monotonic() - t0
        return "no error", 0.0


def test_silent_rank_times_out_instead_of_hanging():
    (err, waited), _ = run_ranks(_silent, 2, free_port(), timeout_s=30)
    assert "ranks [1] did not arrive within 0.5 s" in err and "exchange #" in err
    assert 0.4 < waited < 1.4


def _publish_then_exit(rank: int, world: int, port: int):
    """Rank 1 publishes its last round and exits at once while rank 0 still waits in it: rank 0
    gets that round's result (it is complete), and the lost peer fails its next round."""
    comm = join(rank, world, port, timeout_s=60)
    if rank == 1:
        time.sleep(0.3)
        comm.exchange([5])
        return "left"  # without closing: the process exits, its connection drops
    got = comm.exchange([1])
    time.sleep(0.5)  # the disconnect has surely been reported by now
    try:
        comm.exchange([1])
    except CommunicatorError as e:
        return got, str(e)
    finally:
        comm.close()
    return got, "no error"


def test_a_peer_that_published_and_exited_leaves_a_good_round():
    (got, err), left = run_ranks(_publish_then_exit, 2, free_port(), timeout_s=40)
    assert left == "left" and got == ([5], None)
    assert "rank 0: lost the connection to a peer" in err
