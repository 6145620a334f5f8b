"""StepConsensus on spawned ranks, shared memory and ZMQ side by side: the common step (no news,
no upload) moves only the int record (counted: ``plain_rounds``), and the rounds that carry
rank 0's news or a rank's upload (compact bytes) deliver them exactly, with the same agreement
on both paths."""
import random

import pytest

from megatron_async.inference.communication.shm_slots import supported
from megatron_async.inference.engines.dynamic_engine import StepResult
from megatron_async.inference.engines.request_validation import ValidRequest
from megatron_async.inference.engines.step_consensus import NewRequest, StepConsensus
from megatron_async.inference.request import RequestOutput, RequestUpdate, SamplingParams
from tests.helpers.communicators import join
from tests.helpers.multiprocess import free_port, run_ranks

pytestmark = pytest.mark.skipif(not supported(), reason="shared slots need x86 store ordering")
ROUNDS = 40


def _script(rank: int, world: int) -> list[dict]:
    """Every rank draws every rank's inputs (same seed), so each can also compute the expected result."""
    rng = random.Random(7)
    rounds = []
    for i in range(ROUNDS):
        ins = [dict(work=rng.random() < 0.7, tokens=rng.randrange(0, 300), eager=rng.random() < 0.3,
                    variant=rng.randrange(3), load=rng.randrange(20)) for _ in range(world)]
        prompts = [[rng.randrange(1000) for _ in range(rng.randrange(1, 9))] for _ in range(rng.choice([0, 0, 0, 1, 3]))]
        news = [NewRequest(ValidRequest(p, SamplingParams(top_k=1), [], [], frozenset()), 100 * i + j,
                           rng.randrange(2**40), rng.randrange(world)) for j, p in enumerate(prompts)]
        uploads = [None] + [StepResult(
            finished=[RequestOutput(i, [1], [2, 3], "é", "length")] if rng.random() < 0.3 else [],
            updates=[RequestUpdate(1000 * r + k, (rng.randrange(2**31),), rng.choice([None, "ab"]), False, None)
                     for k in range(rng.randrange(1, 6))]) if rng.random() < 0.3 else None for r in range(1, world)]
        rounds.append(dict(ins=ins, news=news, uploads=uploads))
    return rounds


def _run(rank: int, world: int, ports: tuple[int, int]):
    script, results = _script(rank, world), {}
    for name, port, shm in (("shared_memory", ports[0], True), ("zmq", ports[1], False)):
        with join(rank, world, port, timeout_s=20, shared_memory=shm) as comm:
            assert comm.exchange_path == name
            sync, got = StepConsensus(comm, data_parallel=True), []
            for step in script:
                mine = step["ins"][rank]
                if rank == 0:
                    for n in step["news"]:
                        sync.send(n)
                a = sync.exchange(mine["work"], mine["tokens"], mine["eager"], load=mine["load"],
                                  upload=step["uploads"][rank], variant=mine["variant"])
                ups = [(u.finished, u.updates) for u in sync.take_uploads()]
                got.append((a.any_work, a.max_tokens, a.eager, a.variant, a.loads, list(a.news), ups))
            results[name] = (got, comm.plain_rounds)
    return results


def test_fast_path_and_upload_path_round_trip_exactly():
    world = 3  # two ranks hand up, one leads
    results = run_ranks(_run, world, (free_port(), free_port()), timeout_s=120)
    script = _script(0, world)
    for rank, res in enumerate(results):
        (shm, plain), (zmq_, zmq_plain) = res["shared_memory"], res["zmq"]
        assert shm == zmq_  # the two paths agree exactly
        assert zmq_plain == 0  # ZMQ encodes every message
        expected_plain = 0
        for i, step in enumerate(script):
            ins, uploads = step["ins"], step["uploads"]
            work = any(x["work"] for x in ins) or any(u is not None for u in uploads) or bool(step["news"])
            want = (work, max(x["tokens"] for x in ins), any(x["eager"] for x in ins), max(x["variant"] for x in ins),
                    tuple(x["load"] for x in ins), [n for n in step["news"] if n.rank == rank])
            assert shm[i][:6] == want, (rank, i)
            ups = shm[i][6]
            if rank == 0:  # every upload of this round, by rank, exactly as sent
                assert ups == [(u.finished, u.updates) for u in uploads if u is not None], i
            else:
                assert ups == []
            expected_plain += not step["news"] and (rank == 0 or uploads[rank] is None)
        assert plain == expected_plain and 0 < plain < ROUNDS  # the fast path was taken, and only then


def _bad_upload(rank: int, world: int, ports: tuple[int, int]):
    """Rank 1 hands up bytes that are no upload record: the round itself completes on every rank
    (uploads are read when taken), and rank 0's take_uploads refuses them, naming rank 1."""
    from megatron_async.inference.communication.zmq_communicator import CommunicatorError

    out = {}
    for name, port, shm in (("shared_memory", ports[0], True), ("zmq", ports[1], False)):
        with join(rank, world, port, timeout_s=20, shared_memory=shm) as comm:
            sync = StepConsensus(comm, data_parallel=True)
            good = sync.comm.upload_codec
            if rank == 1:
                comm.upload_codec = (lambda up: b"\xc1 not a record", good[1])
            upload = StepResult(updates=[RequestUpdate(5, (6,), None, False, None)]) if rank else None
            agreed = sync.exchange(True, 3, load=1, upload=upload)
            try:
                taken = sync.take_uploads()
            except CommunicatorError as e:
                taken = str(e)
            comm.barrier()  # every rank got here: nothing hung or died
            out[name] = (agreed.max_tokens, taken if rank == 0 else None)
    return out


def test_an_upload_that_does_not_decode_fails_at_take_on_both_paths():
    results = run_ranks(_bad_upload, 3, (free_port(), free_port()), timeout_s=120)
    for name in ("shared_memory", "zmq"):
        assert all(r[name][0] == 3 for r in results), name
        err = results[0][name][1]
        assert isinstance(err, str) and "rank 1 sent a record that does not decode" in err, (name, err)
