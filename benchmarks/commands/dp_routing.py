"""Engines behind the data-parallel coordinator: prefix-cache hits per routing policy on a
multi-turn workload (DP engines of the tiny model, one process each, against one engine holding
everything), and the cost of the router and the client on null engines.

    python -m benchmarks dp-routing                        # both tables (CPU, a few minutes)
    python -m benchmarks dp-routing --part hits            # 64 conversations x 4 turns on DP=4
    python -m benchmarks dp-routing --part router --requests 20000 --clients 2
    python -m benchmarks dp-routing --smoke                # a small run of both
    python -m benchmarks dp-routing --part hits --policies longest_prefix,scored:0.9

Hits: every conversation's turn t is submitted at once (shuffled), each turn's prompt = the
previous prompt + its answer (greedy, ``--answer`` tokens) + ``--question`` new tokens; engines
cache prefixes (blocks of 16); the DP engines together hold as many KV blocks as the one engine.
The hit share is the DP run's prefix-hit tokens over the one engine's. Router: the median round
trip of one request at a time through client -> coordinator -> null engine (benchmarks/null_engine.py)
-> client, against the null engine's own add_request + step in process and against the same 4
hops over bare ZMQ on this host (benchmarks/bare_relay.py: a relay and an echo process, no
Python work in the hops; over TCP loopback and over ipc, as local peers reach a coordinator), measured in alternating chunks so that both see the same host; then
``--clients`` processes keep ``--window`` requests each in flight: requests per second through
the coordinator, and the coordinator's CPU per request.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bare_relay import BareRelay  # noqa: E402
from benchmarks.null_engine import NullEngine  # noqa: E402
from megatron_async import SamplingParams  # noqa: E402
from megatron_async.client import InferenceClient, SyncInferenceClient  # noqa: E402
from tests.helpers.coordinator_procs import ROOT, Cluster, _env, _wait_line  # noqa: E402

POLICIES = [("load_balanced", 0.5), ("first_prefix_block", 0.5), ("longest_prefix", 0.5), ("scored", 0.5),
            ("scored", 0.9)]


def conversations(n: int, first: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(first)] for _ in range(n)]


def run_turns(args, policy: str, alpha: float, engines: int) -> dict:
    """One policy on ``engines`` engines (fresh processes): hits, requests per engine, seconds."""
    blocks = args.kv_blocks // engines
    flags = ("--prefix-caching", "--block-size", "16", "--num-kv-blocks", str(blocks), "--max-requests",
             str(args.max_requests))
    cluster = Cluster(policy, alpha)
    try:
        for i in range(engines):
            cluster.start_engine(f"e{i}", *flags)
        for i in range(engines):
            cluster.wait_engine(f"e{i}")
        client = SyncInferenceClient(cluster.address)
        rng = random.Random(args.seed + 1)
        convs = conversations(args.conversations, args.first, args.seed)
        params = SamplingParams(top_k=1, num_tokens_to_generate=args.answer, ignore_eos=True)
        prompt_tokens, t0 = 0, time.perf_counter()
        for _ in range(args.turns):
            order = rng.sample(range(len(convs)), len(convs))
            outs = client.generate([convs[c] for c in order], params)
            for c, out in zip(order, outs):
                prompt_tokens += len(convs[c])
                convs[c] = convs[c] + out.generated_tokens + [rng.randrange(1, 1000) for _ in range(args.question)]
        seconds = time.perf_counter() - t0
        stats = client.engine_stats()["engines"]
        listing = client.engines()["engines"]
        client.close()
    finally:
        cluster.close()
    return {"hits": sum(s["prefix_hit_tokens"] for s in stats.values()), "prompt_tokens": prompt_tokens,
            "per_engine": [e["submitted"] for e in listing], "seconds": seconds}


def parse_policies(text: str) -> list[tuple[str, float]]:
    """``name`` or ``name:alpha``, comma-separated (alpha 0.5 where not given)."""
    from megatron_async.config.modes import DpRouting

    out = []
    for item in text.split(","):
        name, _, alpha = item.strip().partition(":")
        if name not in {p.value for p in DpRouting}:
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(p.value for p in DpRouting)}")
        out.append((name, float(alpha) if alpha else 0.5))
    return out


def hits_table(args) -> list[str]:
    one = run_turns(args, "load_balanced", 0.5, 1)
    rows = [f"| one engine, {args.kv_blocks} blocks | {one['hits']:,} | 100 % | {one['per_engine'][0]} | - | "
            f"{one['seconds']:.1f} |"]
    for policy, alpha in args.policies:
        r = run_turns(args, policy, alpha, args.engines)
        name = f"{policy} (alpha {alpha})" if policy == "scored" else policy
        per = r["per_engine"]
        rows.append(f"| {name} | {r['hits']:,} | {100 * r['hits'] / max(1, one['hits']):.0f} % | "
                    f"{min(per)}-{max(per)} | {max(per) / max(1, min(per)):.2f} | {r['seconds']:.1f} |")
        print(rows[-1], flush=True)
    head = [f"DP={args.engines} tiny engines, {args.conversations} conversations x {args.turns} turns "
            f"(prompt tokens {one['prompt_tokens']:,}):", "",
            "| routing | prefix-hit tokens | of one engine's | requests per engine | max / min | seconds |",
            "|---|---:|---:|---:|---:|---:|"]
    return head + rows


# ---------------------------------------------------------------------- router
async def sequential(address: str, n: int, prompt: list[int], bares: tuple[BareRelay, ...] = (),
                     chunk: int = 100) -> tuple[list[float], list[list[float]]]:
    """Round trips of one request at a time through the coordinator, and as many over each bare
    relay of ``bares``, alternating every ``chunk``: seconds each."""
    client = await InferenceClient(address).start()
    params, times, floors = SamplingParams(num_tokens_to_generate=1), [], [[] for _ in bares]
    for i in range(n):
        if i % chunk == 0:
            for bare, floor in zip(bares, floors):
                floor += bare.round_trips(min(chunk, n - i))
        t0 = time.perf_counter()
        await client.add_request(prompt + [i % 1000], params)
        times.append(time.perf_counter() - t0)
    client.close()
    return times, floors


async def windowed(address: str, n: int, window: int, prompt: list[int]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``n`` requests, ``window`` in flight."""
    cpu0 = time.process_time()
    client = await InferenceClient(address).start()
    params, done, sent = SamplingParams(num_tokens_to_generate=1), 0, 0
    t0 = time.perf_counter()
    pending = set()
    while done < n:
        while sent < n and len(pending) < window:
            pending.add(asyncio.ensure_future(_await(client.add_request(prompt + [sent % 1000], params))))
            sent += 1
        finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        done += len(finished)
    client.close()
    return time.perf_counter() - t0, time.process_time() - cpu0


async def _await(fut):
    return await fut


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def router_table(args) -> list[str]:
    prompt = list(range(1, args.prompt_len))
    engine = NullEngine()
    inproc = []
    for i in range(2000):
        t0 = time.perf_counter()
        engine.add_request(prompt, None)
        engine.step()
        inproc.append(time.perf_counter() - t0)
    cluster = Cluster("scored", 0.5)
    nulls, bares = [], []
    try:
        for i in range(args.null_engines):
            nulls.append(subprocess.Popen([sys.executable, "-m", "benchmarks.null_engine", cluster.address, f"null{i}"],
                                          stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT))
        for p in nulls:
            _wait_line(p, "megatron_async.serve: engine ", 120)
        bares.append(BareRelay())
        bares.append(BareRelay(ipc=True))
        asyncio.run(sequential(cluster.address, 200, prompt))  # warm
        times, floors = asyncio.run(sequential(cluster.address, args.sequential, prompt, tuple(bares)))
        rtt, (tcp, ipc) = statistics.median(times), [statistics.median(f) for f in floors]
        cpu0 = [cpu_seconds(p.pid) for p in (cluster.coordinator, *nulls)]
        per_client = args.requests // args.clients
        loaders = [subprocess.Popen([sys.executable, "-m", "benchmarks", "dp-routing", "--load-client",
                                     cluster.address, str(per_client), str(args.window), str(args.prompt_len)],
                                    stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT) for _ in range(args.clients)]
        done = [p.communicate(timeout=600)[0].split()[-2:] for p in loaders]
        walls, client_cpu = [float(w) for w, _ in done], sum(float(c) for _, c in done)
        cpu = [cpu_seconds(p.pid) - c for p, c in zip((cluster.coordinator, *nulls), cpu0)]
    finally:  # the coordinator first: engines killed under it would be logged as lost, at ERROR
        cluster.close()
        for p in nulls:
            p.kill()
            p.wait(10)
        for bare in bares:
            bare.close()
    total = per_client * args.clients
    return [f"router: {args.null_engines} null engines, routing 'scored', prompts of {args.prompt_len} tokens:", "",
            "| measure | value |", "|---|---:|",
            f"| in-process null add_request + step, median | {1e6 * statistics.median(inproc):.0f} us |",
            f"| client -> coordinator -> engine -> client, one at a time, median | {1e6 * rtt:.0f} us |",
            f"| added by routing and the round trip, median | {1e6 * (rtt - statistics.median(inproc)):.0f} us |",
            f"| the same hops over bare ZMQ on this host (relay + echo processes), TCP, median | {1e6 * tcp:.0f} us |",
            f"| the same over ipc (as local peers reach the coordinator), median | {1e6 * ipc:.0f} us |",
            f"| added above the TCP floor, median | {1e6 * (rtt - tcp):.0f} us |",
            f"| added above the ipc floor, median | {1e6 * (rtt - ipc):.0f} us |",
            f"| throughput, {args.clients} clients x {args.window} in flight | {total / max(walls):,.0f} requests/s |",
            f"| coordinator CPU per request | {1e6 * cpu[0] / total:.1f} us |",
            f"| engines' CPU per request (null engines, their links) | {1e6 * sum(cpu[1:]) / total:.1f} us |",
            f"| clients' CPU per request | {1e6 * client_cpu / total:.1f} us |",
            f"| load average (1 min) after | {os.getloadavg()[0]:.2f} |"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["hits", "router", "all"], default="all")
    p.add_argument("--smoke", action="store_true", help="a small run of each part (CPU, tens of seconds)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--policies", type=parse_policies, default=POLICIES,
                   help="hits: routing policies to run, comma-separated name or name:alpha (default: all five rows)")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=48, help="tokens of a conversation's first prompt")
    p.add_argument("--answer", type=int, default=32)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks of all engines together")
    p.add_argument("--max-requests", type=int, default=64)
    p.add_argument("--null-engines", type=int, default=2)
    p.add_argument("--sequential", type=int, default=2000)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=33)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-client", nargs=4, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:  # smaller defaults; flags given still win
        p.set_defaults(conversations=8, turns=2, answer=8, question=8, sequential=200, requests=2000, window=64)
        args = p.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.load_client:
        address, n, window, plen = args.load_client
        print(*asyncio.run(windowed(address, int(n), int(window), list(range(1, int(plen))))))
        return
    out = []
    if args.part in ("hits", "all"):
        out += hits_table(args) + [""]
    if args.part in ("router", "all"):
        out += router_table(args)
    print("\n".join(out))


if __name__ == "__main__":
    main()
