"""A stranger attacks every endpoint of a running 2- and 4-rank job (data-parallel tiny-moe on CPU,
rank 0 listening on TCP towards MASTER_ADDR as well as on its private ipc:// socket, as when the
ranks span hosts): connections that leave at once, random bytes, malicious pickles, well-formed
frames without a handshake, a handshake under a real rank's name with a forged proof, chosen ZMQ
identities, oversized frames, raw TCP garbage (tests/helpers/strangers.py), round after round
while the ranks generate; and at the join, before the other ranks connect, it claims every
rank's name on rank 0's endpoints with a forged proof. The job must finish with every output equal to an undisturbed engine's,
nothing must execute (the canary file is never created), and rank 0's counters
(``EngineStats.consensus_wire``) must show what it dropped and refused.

Both exchange paths: ZMQ (strangers' frames arrive on the socket the collectives read) and shared
memory (the socket only watches liveness: a stranger's close must not read as a rank's death)."""
from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.multiprocess import run_ranks
from tests.helpers.strangers import attack

CONFIG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16, max_sequence_length=128)
PROMPTS = [[3, 17, 42, 9, 100, 7], [250, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68], [8, 9], [11, 12, 13]]
PARAMS = [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True) if i % 2 else
          SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=n, ignore_eos=True, seed=1000 + i)
          for i, n in enumerate((6, 9, 4, 7, 5, 8))]
ROUNDS = 2
"""Complete attack rounds on every endpoint that must land while the ranks generate."""
MAX_GENERATES = 40


def _listen_on_tcp_too() -> None:
    """Rank 0 binds TCP towards MASTER_ADDR besides its ipc socket (as for ranks on several hosts)."""
    from megatron_async.inference.communication import zmq_transport

    plan = zmq_transport.plan
    zmq_transport.plan = lambda store, rank, world, key, force_tcp=False: plan(store, rank, world, key, True)


def _late_until_claimed(out: Path) -> None:
    """This rank proves its key only once the stranger has claimed its name."""
    from megatron_async.inference.communication import zmq_transport

    authenticate = zmq_transport.authenticate

    def late(*args, **kwargs):
        deadline = time.monotonic() + 30
        while not (out / "claimed").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return authenticate(*args, **kwargs)

    zmq_transport.authenticate = late


def _publish_endpoints_at_bind(out: Path) -> None:
    """Rank 0 tells the stranger its endpoints as soon as it bound them (as the store does)."""
    from megatron_async.inference.communication.zmq_transport import ZMQTransport

    bind = ZMQTransport._bind

    def published(self, store, key):
        bind(self, store, key)
        (out / "joining.tmp").write_text(json.dumps(self.endpoints))
        (out / "joining.tmp").rename(out / "joining")

    ZMQTransport._bind = published


def _worker(rank: int, world: int, shared_memory: bool, out_dir: str) -> dict:
    _listen_on_tcp_too()
    out = Path(out_dir)
    if rank:
        _late_until_claimed(out)
    else:
        _publish_endpoints_at_bind(out)
    llm = LLM(None, inference_config=InferenceConfig(**CONFIG, consensus_shared_memory=shared_memory),
              default_model="tiny-moe", expert_parallel_size=world)
    try:
        if rank == 0:
            (out / "endpoints.tmp").write_text(json.dumps(llm.communicator.transport.endpoints))
            (out / "endpoints.tmp").rename(out / "endpoints")
        runs = []
        while True:
            runs.append([o.generated_tokens for o in llm.generate(PROMPTS, PARAMS)])
            attacked = rank == 0 and len(list(out.glob("round-*"))) >= ROUNDS
            if llm.communicator.broadcast_object(attacked or len(runs) >= MAX_GENERATES):
                break
        st = llm.engine.stats.consensus_wire
        wire = None if st is None else {"dropped": dict(st.dropped), "auth_failed": st.auth_failed,
                                        "authenticated": st.authenticated, "disconnects": st.stranger_disconnects}
        return {"runs": runs, "wire": wire, "path": llm.communicator.exchange_path,
                "endpoints": llm.communicator.transport.endpoints}
    finally:
        llm.close()


def _claim_names(world: int, out: Path) -> list:
    """At the join: a HELLO under every other rank's name and a forged PROOF on each of rank 0's
    endpoints, on connections left open."""
    import msgpack
    import zmq

    endpoints = _wait_json(out / "joining")
    socks = []
    for ep in endpoints or ():
        for r in range(1, world):
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            s.send(msgpack.packb([1, 1, "rank", str(r), b"n" * 32]))
            s.send(msgpack.packb([3, b"m" * 32]))
            socks.append(s)
    time.sleep(0.5)  # rank 0 reads them while it waits for the ranks
    return socks


def _wait_json(path: Path, stop: threading.Event | None = None):
    deadline = time.monotonic() + 120
    while not path.exists():
        if (stop is not None and stop.is_set()) or time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    return json.loads(path.read_text())


def _stranger(world: int, out: Path, canary: str, stop: threading.Event, tried: list) -> None:
    try:
        claimed = _claim_names(world, out)
    finally:
        (out / "claimed").touch()
    endpoints = _wait_json(out / "endpoints", stop)
    for s in claimed:
        s.close(0)
    rng, n = random.Random(0), 0
    while endpoints and not stop.is_set():
        try:
            for ep in endpoints:
                tried.append((ep, attack(ep, rng, canary, heavy=n == 0)))
        except OSError:  # the job ended and closed its endpoints
            return
        n += 1
        (out / f"round-{n}").touch()


@pytest.fixture(scope="module")
def undisturbed() -> list[list[int]]:
    return [o.generated_tokens for o in
            LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe").generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("world,shared_memory", [(2, False), (4, True)])
def test_a_stranger_on_every_endpoint_changes_nothing(world, shared_memory, undisturbed, tmp_path):
    canary = str(tmp_path / "canary")
    stop, tried = threading.Event(), []
    t = threading.Thread(target=_stranger, args=(world, tmp_path, canary, stop, tried), daemon=True)
    t.start()
    try:
        ranks = run_ranks(_worker, world, shared_memory, str(tmp_path), timeout_s=300)
    finally:
        stop.set()
        t.join(60)
    r0 = ranks[0]
    assert {e.split("://")[0] for e in r0["endpoints"]} == {"ipc", "tcp"}
    assert {ep for ep, _ in tried} == set(r0["endpoints"]) and "raw TCP garbage" in sum((d for _, d in tried), [])
    assert r0["path"] == ("shared_memory" if shared_memory else "zmq")
    assert len(r0["runs"]) < MAX_GENERATES, "the stranger never finished its rounds while the ranks generated"
    for rank, got in enumerate(ranks):
        assert all(run == undisturbed for run in got["runs"]), f"rank {rank}'s outputs changed"
    assert not Path(canary).exists(), "a stranger's pickle was executed"
    wire = r0["wire"]
    assert wire["authenticated"] == world - 1  # the job's ranks, nobody else
    # every forged proof under a rank's name refused: at the join (the names stayed the ranks'), then each round
    assert wire["auth_failed"] >= 2 * (world - 1) + 3 * ROUNDS, wire
    for reason in ("malformed", "unauthenticated", "oversized", "bad hello"):
        assert wire["dropped"].get(reason, 0) >= ROUNDS, (reason, wire)
    assert wire["disconnects"] >= 10 * ROUNDS, wire  # every stranger's close counted, none read as a death
    assert all(r["wire"] is None for r in ranks[1:])  # only rank 0 listens
