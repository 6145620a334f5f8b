"""Cost of the per-step consensus: N spawned ranks on one host (gloo or NCCL job + ZMQ).

1. The bare exchange: ``StepConsensus.exchange`` back to back through each path, the ZMQ round
   trip through rank 0 (Unix socket, as engines on one host use it) and the shared-memory slots
   (the default on one host), with rank 0 sending one new request every 4th step; tensor
   parallel (no uploads) and data parallel (every other rank uploads 8 streaming updates every
   step, as decoding ranks do). Per round: p50 / p99 of its duration on a rank, and of its own
   cost (from the last rank's arrival to this rank holding the result: the part that is not
   waiting for a slower rank). The first 10% of rounds are dropped (warm-up).
2. In the engines: a launch-ahead run of a TP engine and of an EP (data-parallel) engine per
   rank count (``--device cuda``: qwen3-0.6b shape for TP, a 4-layer qwen3-30b-a3b shape for
   EP, bf16, one GPU per rank; cpu: tiny / tiny-moe), shared memory (``--zmq-engines``: ZMQ
   too). Per rank, p50 of each exchange's duration, its work (duration less the wait for
   peers), its own cost (as above); rounds that pickled nothing, waits that slept; the share of
   exchanges made while a launch was in flight and, on CUDA, while the device still ran it.
   Then the phases of a round (round_probe.py) for the bare exchange next to the engines.

3. Every K steps instead (``--windows``): a trace of a data-parallel run that agrees every step
   (tiny-moe, staggered greedy and sampled arrivals, CUDA graphs emulated on the CPU so the
   graph / eager decisions are the real ones), replayed with windows of K steps
   (benchmarks/consensus_windows.py): exchanges saved against padding, graph steps
   lost, extra dummy forwards and admission delay.

    python -m benchmarks consensus --ranks 2 4 --iters 2000 [--skip-engine | --skip-bare] [--windows 1 2 4 8]
    python -m benchmarks consensus --ranks 2 --iters 2000 --device cuda --tokens 128   # a GPU host
    python -m benchmarks consensus --ranks 2 --cold   # why the engine's rounds cost more than bare ones
    python -m benchmarks consensus --decode 8 64 --iters 20000   # rank 0's own work in a DP round, one process
"""
from __future__ import annotations

import argparse
import random
import time

from megatron_async.inference.communication.round_probe import PHASES, RoundProbe
from megatron_async.inference.communication.zmq_communicator import ZMQCommunicator
from megatron_async.inference.engines.dynamic_engine import StepResult
from megatron_async.inference.engines.request_validation import ValidRequest
from megatron_async.inference.engines.step_consensus import NewRequest, StepConsensus
from megatron_async.inference.request import RequestUpdate, SamplingParams
from tests.helpers.multiprocess import free_port, run_ranks

NEW = NewRequest(ValidRequest(list(range(64)), SamplingParams(top_k=1), [], [], frozenset()), 0, 1)
UPDATES = [RequestUpdate(i, (1000 + i,), None, False, None) for i in range(8)]
PATHS = {"zmq": False, "shared_memory": True}


def _communicator(rank: int, world: int, store_port: int, shared_memory: bool, spin_us: float | None
                  ) -> ZMQCommunicator:
    """Joined as engines join (through the job's store: IPC for ZMQ on one host)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, world, rank == 0, timeout=timedelta(seconds=60))
    return ZMQCommunicator.from_rendezvous(store, rank, world, timeout_s=60, shared_memory=shared_memory,
                                           spin_us=spin_us)


def _bare(rank: int, world: int, store_port: int, iters: int, data_parallel: bool, shared_memory: bool,
          spin_us: float | None) -> dict:
    with _communicator(rank, world, store_port, shared_memory, spin_us) as comm:
        sync = StepConsensus(comm, data_parallel=data_parallel)
        rounds, own, take = [], [], []
        for i in range(iters):
            if rank == 0 and i % 4 == 0:
                sync.send(NEW)
            upload = StepResult(updates=list(UPDATES)) if data_parallel and rank else None
            sync.exchange(True, num_tokens=64, load=3, upload=upload)
            t0 = time.perf_counter()
            sync.take_uploads()  # as the engine does, after each round (outside the timed exchange)
            take.append(time.perf_counter() - t0)
            rounds.append(sync.round_seconds)
            own.append(sync.latency_seconds)
        skip = iters // 10
        return {"round": rounds[skip:], "own": own[skip:], "take": take[skip:], "path": comm.exchange_path}


def bare_table(ranks: list[int], iters: int, spin_us: float | None) -> None:
    print("| ranks | mode | path | round p50 / p99 us | own cost p50 / p99 us | rank 0's take_uploads p50 us |")
    print("|---|---|---|---|---|---|")
    for world in ranks:
        for dp in (False, True):
            for name, shm in PATHS.items():
                res = run_ranks(_bare, world, free_port(), iters, dp, shm, spin_us, timeout_s=600)
                assert all(r["path"] == name for r in res), [r["path"] for r in res]
                rounds = [t for r in res for t in r["round"]]
                own = [t for r in res for t in r["own"]]
                print(f"| {world} | {'data parallel' if dp else 'tensor parallel'} | {name} "
                      f"| {us(rounds, .5):.0f} / {us(rounds, .99):.0f} | {us(own, .5):.0f} / {us(own, .99):.0f} "
                      f"| {us(res[0]['take'], .5):.0f} |", flush=True)


ENGINE_MODELS = {"cpu": {"tp": ("tiny", None), "ep": ("tiny-moe", None)},
                 "cuda": {"tp": ("qwen3-0.6b", None), "ep": ("qwen3-30b-a3b", 4)}}
"""Per device and kind: the built-in model and its decoder layers (None: all)."""
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _engine(rank: int, world: int, parallel: str, shared_memory: bool, tokens: int, device: str) -> dict:
    """A launch-ahead run under TP (``parallel`` "tp": replica engines) or EP ("ep":
    data-parallel engines), 8 requests per rank of ``tokens`` greedy tokens, after a short
    warm-up run. Per exchange of the timed run: its duration, its own work
    (duration less the wait for peers), its own cost (after the last rank arrived);
    whether a launch was in flight during it and, on CUDA, whether the device was still running
    that launch when the exchange ended (the exchange was hidden under the device step). Then
    the timed run again with the round probe on: the phases."""
    from megatron_async import LLM, InferenceConfig
    from megatron_async import SamplingParams as SP
    from megatron_async.models.default_model import DEFAULT_CONFIGS

    base, layers = ENGINE_MODELS[device][parallel]
    name = base if layers is None else f"{base}-{layers}l"
    DEFAULT_CONFIGS[name] = {**DEFAULT_CONFIGS[base], **({"num_hidden_layers": layers} if layers else {})}
    cfg = InferenceConfig(block_size_tokens=16, num_kv_blocks=1024, max_requests=16, max_tokens=512,
                          max_sequence_length=512, consensus_shared_memory=shared_memory,
                          cuda_graphs=device == "cuda")
    sizes = {"tensor_parallel_size": world} if parallel == "tp" else {"expert_parallel_size": world}
    llm = LLM(None, device=device, dtype="bfloat16" if device == "cuda" else "float32", inference_config=cfg,
              default_model=name, **sizes)
    try:
        eng, comm = llm.engine, llm.communicator
        busy, in_flight, agree = [], [], eng.ranks.agree

        def watched(*a, **kw):
            got = agree(*a, **kw)
            pending = eng._pending
            in_flight.append(pending is not None)
            if pending is not None and pending.event is not None:
                busy.append(not pending.event.query())  # no sync: is the device still on that launch?
            return got

        eng.ranks.agree = watched
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(16 + 4 * i)] for i in range(8 * world)]
        llm.generate(prompts[:2 * world], SP(top_k=1, num_tokens_to_generate=8, ignore_eos=True))  # warm-up
        st = eng.stats
        for q in (st.consensus_round_seconds, st.consensus_latency_seconds, st.consensus_work_seconds, busy,
                  in_flight):
            q.clear()
        sleeps0, plain0, rounds0 = comm.sleeps, comm.plain_rounds, st.consensus_rounds
        t0 = time.perf_counter()
        llm.generate(prompts, SP(top_k=1, num_tokens_to_generate=tokens, ignore_eos=True))
        wall = time.perf_counter() - t0
        got = {"path": comm.exchange_path, "rounds": st.consensus_rounds - rounds0,
               "round": st.consensus_us(50), "work": st.consensus_work_us(50), "own": st.consensus_latency_us(50),
               "own_p99": st.consensus_latency_us(99), "sleeps": comm.sleeps - sleeps0,
               "plain": comm.plain_rounds - plain0, "spin_us": comm.spin_us,
               "in_flight": sum(in_flight) / max(1, len(in_flight)),
               "busy": sum(busy) / len(busy) if busy else None, "wall": wall}
        # the same run again with the probe on, for the phases (its marks cost a little: not in the numbers above)
        probe = comm.probe = RoundProbe()
        llm.generate(prompts, SP(top_k=1, num_tokens_to_generate=tokens, ignore_eos=True))
        return {**got, "phases": probe.p50_us(skip=0), "take": probe.p50_us("take_uploads", skip=0)}
    finally:
        llm.close()


def engine_table(ranks: list[int], tokens: int, device: str, paths: dict[str, bool]) -> list:
    """Own cost per round of the TP and EP engines (each path), by rank. Returns the shared-memory
    runs' (ranks, kind, per-rank results) for ``breakdown_table``."""
    env = NCCL_ENV if device == "cuda" else {}
    print(f"\nEngines ({device}, launch-ahead; p50 over the timed run's exchanges, by rank; \"work\": the "
          "exchange less its wait for peers; \"own cost\": from the last rank's arrival to holding the result; "
          "\"hidden\": the device was still running the in-flight step when the exchange ended)")
    print("\n| ranks | engine | path | rounds | round us | work us | own cost us | own cost p99 us | plain rounds "
          "| sleeps (spin us) | in flight | hidden | wall s |")
    print("|---|---|---|---:|---|---|---|---|---|---|---|---|---:|")
    kept = []
    for world in ranks:
        for parallel in ("tp", "ep"):
            for name, shm in paths.items():
                res = run_ranks(_engine, world, parallel, shm, tokens, device, timeout_s=600, env=env)
                assert all(r["path"] == name for r in res), [r["path"] for r in res]

                def by_rank(key: str, fmt: str = "{:.0f}") -> str:
                    return " / ".join("-" if r[key] is None else fmt.format(r[key]) for r in res)

                spin = res[0]["spin_us"]
                print(f"| {world} | {parallel.upper()} | {name} | {res[0]['rounds']} | {by_rank('round')} "
                      f"| {by_rank('work')} | {by_rank('own')} | {by_rank('own_p99')} | {by_rank('plain')} "
                      f"| {by_rank('sleeps')} ({'-' if spin is None else f'{spin:.0f}'}) "
                      f"| {by_rank('in_flight', '{:.0%}')} | {by_rank('busy', '{:.0%}')} "
                      f"| {max(r['wall'] for r in res):.1f} |", flush=True)
                if shm:
                    kept.append((world, f"engine {parallel.upper()}", res))
    return kept


def _bare_probed(rank: int, world: int, store_port: int, iters: int, data_parallel: bool) -> dict:
    """The bare exchange as the engines call it (rank 0 takes the uploads after each round), probed."""
    with _communicator(rank, world, store_port, True, None) as comm:
        comm.probe = RoundProbe()
        sync = StepConsensus(comm, data_parallel=data_parallel)
        for i in range(iters):
            if rank == 0 and i % 4 == 0:
                sync.send(NEW)
            upload = StepResult(updates=list(UPDATES)) if data_parallel and rank else None
            sync.exchange(True, num_tokens=64, load=3, upload=upload)
            sync.take_uploads()
        return {"phases": comm.probe.p50_us(), "take": comm.probe.p50_us("take_uploads")}


def breakdown_table(world: int, iters: int, engines: list) -> None:
    """Per-phase p50 us of a round on shared memory, by rank: the bare exchange and ``engines``
    (``engine_table``'s shared-memory runs)."""
    rows = [(world, f"bare {'DP' if dp else 'TP'}", run_ranks(_bare_probed, world, free_port(), iters, dp))
            for dp in (False, True)]
    print("\nPhases of a shared-memory round, p50 us by rank (round_probe.py; \"total\" and \"work\" are p50s of "
          "the sums, not sums of the p50s; bare DP: every other rank uploads 8 updates a round)")
    print(f"\n| ranks | what | rank | {' | '.join(PHASES)} | total | work | take_uploads |")
    print("|---|---|---:|" + "---:|" * (len(PHASES) + 3))
    for w, what, res in rows + engines:
        for rank, r in enumerate(res):
            ph = r["phases"]
            print(f"| {w} | {what} | {rank} | " + " | ".join(f"{ph.get(c, 0):.1f}" for c in PHASES)
                  + f" | {ph.get('total', 0):.1f} | {ph.get('work', 0):.1f} | {r['take'].get('total', 0):.1f} |")


def _trace(rank: int, world: int) -> list[tuple[int, bool, int]]:
    """This rank's (tokens, agreed eager, requests admitted) at every step's exchange."""
    from megatron_async import LLM, InferenceConfig
    from megatron_async import SamplingParams as SP
    from tests.helpers.emulated_graphs import EmulatedGraphRunner
    from tests.helpers.engine_harness import run_leader_arrivals

    cfg = InferenceConfig(block_size_tokens=16, num_kv_blocks=512, max_requests=8, max_tokens=64,
                          max_sequence_length=256)
    llm = LLM(None, inference_config=cfg, default_model="tiny-moe", expert_parallel_size=world)
    try:
        graphs = llm.runner.graphs = EmulatedGraphRunner(llm.runner, llm.config.graph_sizing(), collective=True)
        graphs.warmup()
        eng, records, agree = llm.engine, [], llm.engine.ranks.agree

        def recorded(from_step, out, num_tokens=0, eager=False, upload=None, **rest):
            got = agree(from_step, out, num_tokens, eager, upload, **rest)
            if from_step:
                records.append((num_tokens, got.eager, len(got.news)))
            return got

        eng.ranks.agree = recorded
        rng = random.Random(0)  # irregular arrivals (mean gap 2 steps), the same on every rank
        at = [sum(rng.choice((0, 1, 1, 2, 3, 5)) for _ in range(i + 1)) for i in range(12 * world)]
        greedy = [SP(top_k=1, num_tokens_to_generate=8 + 4 * (i % 5), ignore_eos=True) for i in range(12 * world)]
        sampled = [SP(temperature=0.8, num_tokens_to_generate=10, ignore_eos=True, seed=i) for i in range(12 * world)]
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(4 + 3 * (i % 5))] for i in range(12 * world)]
        arrivals = [(at[i], prompts[i], greedy[i] if i % 4 else sampled[i]) for i in range(12 * world)]
        run_leader_arrivals(llm, rank, arrivals, max_steps=5000)
        return records
    finally:
        llm.close()


def _cold(rank: int, world: int) -> dict:
    """The engine's exchange back to back, then with other work between rounds (what the
    engine does between two steps): per-phase p50 us of each."""
    import torch

    from megatron_async import LLM, InferenceConfig
    from megatron_async import SamplingParams as SP

    cfg = InferenceConfig(block_size_tokens=16, num_kv_blocks=256, max_requests=8, max_tokens=128,
                          max_sequence_length=128)
    llm = LLM(None, inference_config=cfg, default_model="tiny-moe", expert_parallel_size=world)
    try:
        llm.generate([[1, 2, 3]] * 2 * world, SP(top_k=1, num_tokens_to_generate=4, ignore_eos=True))
        sync, x, out = llm.engine.ranks.consensus, torch.randn(256, 256), {}
        between = {"nothing": None, "20 matmuls 256x256": lambda: [x @ x for _ in range(20)],
                   "3000 small dicts": lambda: [dict(a=i) for i in range(3000)], "2 ms sleep": lambda: time.sleep(2e-3)}
        for name, work in between.items():
            probe = sync.comm.probe = RoundProbe()
            for _ in range(300):
                if work is not None:
                    work()
                sync.exchange(True, 4, load=1)
            out[name] = probe.p50_us()
        return out
    finally:
        llm.close()


def cold_table(world: int) -> None:
    print("\nThe engine's exchange with other work between rounds, p50 us by rank (work: less the wait)")
    print("\n| between rounds | rank | build | publish | read | apply | work |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    res = run_ranks(_cold, world, timeout_s=600)
    for name in res[0]:
        for rank, r in enumerate(res):
            ph = r[name]
            print(f"| {name} | {rank} | " + " | ".join(f"{ph.get(c, 0):.1f}" for c in ("build", "publish", "read",
                                                                                         "apply", "work")) + " |")


def windows_table(ranks: list[int], ks: list[int]) -> None:
    from benchmarks.consensus_windows import TraceStep, window_costs

    print("\n| ranks | K | exchanges / step | extra padded MoE rows % | graph steps lost % | extra dummy forwards "
          "| admission delay (steps, mean) |")
    print("|---|---|---|---|---|---|---|")
    for world in ranks:
        per_rank = run_ranks(_trace, world, timeout_s=900)
        trace = [TraceStep(tuple(r[0] for r in step), step[0][1], sum(r[2] for r in step))
                 for step in zip(*per_rank)]
        for k in ks:
            c = window_costs(trace, k)
            print(f"| {world} | {k} | {c.exchanges_per_step:.2f} | {c.padded_rows_pct:.0f} "
                  f"| {c.graph_steps_lost_pct:.0f} | {c.extra_dummy_forwards} | {c.mean_admission_delay_steps:.2f} |")
        working = [s for s in trace if max(s.tokens)]
        print(f"| {world} | (trace) | {len(trace)} steps | | {sum(not s.eager for s in working)} graph steps "
              f"| {sum(t == 0 for s in working for t in s.tokens)} dummy forwards at K=1 | |")


def us(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1e6 * xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-bare", action="store_true")
    p.add_argument("--spin-us", type=float, default=None, help="InferenceConfig.consensus_spin_us (default: automatic)")
    p.add_argument("--windows", type=int, nargs="*", default=None, help="window sizes K to replay a trace with")
    p.add_argument("--tokens", type=int, default=64, help="engine runs: greedy tokens per request")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="engine runs: one device per rank")
    p.add_argument("--zmq-engines", action="store_true", help="engine runs over ZMQ too (shared memory only else)")
    p.add_argument("--cold", action="store_true", help="only: the exchange with other work between rounds (CPU)")
    p.add_argument("--decode", type=int, nargs="*", default=None,
                   help="only: rank 0's reading of uploads of these many updates, in one process")
    args = p.parse_args()
    if args.decode is not None:
        from benchmarks.consensus_decode import decode_table

        decode_table(args.ranks, args.decode or [8, 64], args.iters)
        return
    if args.cold:
        cold_table(args.ranks[0])
        return
    if args.windows:
        windows_table(args.ranks, args.windows)
        return
    if not args.skip_bare:
        bare_table(args.ranks, args.iters, args.spin_us)
    if args.skip_engine:
        return
    paths = PATHS if args.zmq_engines else {"shared_memory": True}
    engines = engine_table(args.ranks, args.tokens, args.device, paths)
    breakdown_table(args.ranks[0], args.iters, [e for e in engines if e[0] == args.ranks[0]])


if __name__ == "__main__":
    main()
