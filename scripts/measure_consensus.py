"""Cost of the per-step consensus on the CPU: N spawned ranks on one host (gloo job + ZMQ).

1. The bare exchange: ``StepConsensus.exchange`` back to back through each path, the ZMQ round
   trip through rank 0 (Unix socket, as engines on one host use it) and the shared-memory slots
   (the default on one host), with rank 0 sending one new request every 4th step; tensor
   parallel (no uploads) and data parallel (every other rank uploads 8 streaming updates every
   step, as decoding ranks do). Per round: p50 / p99 of its duration on a rank, and of its own
   cost (from the last rank's arrival to this rank holding the result: the part that is not
   waiting for a slower rank). The first 10% of rounds are dropped (warm-up).
2. In the engine: EngineStats of a launch-ahead run of the built-in MoE model with data-parallel
   engines (expert_parallel_size=N) on each path: consensus us per round (waits for the slowest
   rank included) and its own cost p50 (``consensus_latency_us``), next to the wall time.

3. Every K steps instead (``--windows``): a trace of a data-parallel run that agrees every step
   (tiny-moe, staggered greedy and sampled arrivals, CUDA graphs emulated on the CPU so the
   graph / eager decisions are the real ones), replayed with windows of K steps
   (megatron_async/tools/consensus_windows.py): exchanges saved against padding, graph steps
   lost, extra dummy forwards and admission delay.

    python scripts/measure_consensus.py --ranks 2 4 --iters 2000 [--skip-engine | --skip-bare] [--windows 1 2 4 8]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from megatron_async.inference.communication.zmq_communicator import ZMQCommunicator
from megatron_async.inference.engines.request_validation import ValidRequest
from megatron_async.inference.engines.step_consensus import NewRequest, StepConsensus
from megatron_async.inference.request import RequestUpdate, SamplingParams
from megatron_async.testing.multiprocess import free_port, run_ranks

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
        rounds, own = [], []
        for i in range(iters):
            if rank == 0 and i % 4 == 0:
                sync.send(NEW)
            upload = list(UPDATES) if data_parallel and rank else None
            sync.exchange(True, num_tokens=64, load=3, upload=upload)
            rounds.append(sync.round_seconds)
            own.append(sync.latency_seconds)
        return {"round": rounds[iters // 10:], "own": own[iters // 10:], "path": comm.exchange_path}


def bare_table(ranks: list[int], iters: int, spin_us: float | None) -> None:
    print("| ranks | mode | path | round p50 / p99 us | own cost p50 / p99 us |")
    print("|---|---|---|---|---|")
    for world in ranks:
        for dp in (False, True):
            for name, shm in PATHS.items():
                res = run_ranks(_bare, world, free_port(), iters, dp, shm, spin_us, timeout_s=600)
                assert all(r["path"] == name for r in res), [r["path"] for r in res]
                rounds = [t for r in res for t in r["round"]]
                own = [t for r in res for t in r["own"]]
                print(f"| {world} | {'data parallel' if dp else 'tensor parallel'} | {name} "
                      f"| {us(rounds, .5):.0f} / {us(rounds, .99):.0f} | {us(own, .5):.0f} / {us(own, .99):.0f} |",
                      flush=True)


def _engine(rank: int, world: int, shared_memory: bool, spin_us: float | None) -> dict:
    from megatron_async import LLM, InferenceConfig

    cfg = InferenceConfig(block_size_tokens=16, num_kv_blocks=512, max_requests=16, max_tokens=256,
                          max_sequence_length=256, consensus_shared_memory=shared_memory, consensus_spin_us=spin_us)
    llm = LLM(None, inference_config=cfg, default_model="tiny-moe", expert_parallel_size=world)
    try:
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(16 + 4 * i)] for i in range(8 * world)]
        from megatron_async import SamplingParams as SP

        t0 = time.perf_counter()
        llm.generate(prompts, SP(top_k=1, num_tokens_to_generate=32, ignore_eos=True))
        wall = time.perf_counter() - t0
        st = llm.engine.stats
        return {"rounds": st.consensus_rounds, "seconds": st.consensus_time, "steps": st.steps,
                "own_p50": st.consensus_latency_us(50), "dummy": st.dummy_steps, "wall": wall,
                "path": llm.communicator.exchange_path}
    finally:
        llm.close()


def _trace(rank: int, world: int) -> list[tuple[int, bool, int]]:
    """This rank's (tokens, agreed eager, requests admitted) at every step's exchange."""
    from megatron_async import LLM, InferenceConfig
    from megatron_async import SamplingParams as SP
    from megatron_async.testing.emulated_graphs import EmulatedGraphRunner
    from tests.functional_tests.engine_harness import run_leader_arrivals

    cfg = InferenceConfig(block_size_tokens=16, num_kv_blocks=512, max_requests=8, max_tokens=64,
                          max_sequence_length=256)
    llm = LLM(None, inference_config=cfg, default_model="tiny-moe", expert_parallel_size=world)
    try:
        graphs = llm.controller.graphs = EmulatedGraphRunner(llm.controller, llm.config, collective=True)
        graphs.warmup()
        eng, records, agree = llm.engine, [], llm.engine._agree

        def recorded(from_step, out, num_tokens=0, eager=False, upload=None):
            got = agree(from_step, out, num_tokens, eager, upload)
            if from_step:
                records.append((num_tokens, got.eager, len(got.news)))
            return got

        eng._agree = recorded
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


def windows_table(ranks: list[int], ks: list[int]) -> None:
    from megatron_async.tools.consensus_windows import TraceStep, window_costs

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
    args = p.parse_args()
    if args.windows:
        windows_table(args.ranks, args.windows)
        return
    if not args.skip_bare:
        bare_table(args.ranks, args.iters, args.spin_us)
    if args.skip_engine:
        return
    print("\n| ranks | path | rounds | steps (rank 0) | consensus us / round (by rank) | own cost p50 us (by rank) "
          "| wall s |")
    print("|---|---|---|---|---|---|---|")
    for world in args.ranks:
        for name, shm in PATHS.items():
            res = run_ranks(_engine, world, shm, args.spin_us, timeout_s=600)
            assert all(r["path"] == name for r in res)
            per = " / ".join(f"{1e6 * r['seconds'] / max(1, r['rounds']):.0f}" for r in res)
            own = " / ".join(f"{r['own_p50']:.0f}" for r in res)
            print(f"| {world} | {name} | {res[0]['rounds']} | {res[0]['steps']} | {per} | {own} "
                  f"| {statistics.mean(r['wall'] for r in res):.1f} |", flush=True)


if __name__ == "__main__":
    main()
