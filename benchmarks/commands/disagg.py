"""Prefill / decode disaggregation against data parallelism: the same arrivals (Poisson at
``--rate``, prompts of ``--min-prompt``..``--max-prompt`` tokens, ``--output`` tokens each, all
streamed) through DP=2 mixed engines and through 1 prefill + 1 decode engine behind one
coordinator (engine processes of the tiny model on the CPU unless ``--engine-flags`` say
otherwise); one table: TTFT, TPOT, inter-token gaps p50 / p99, output tokens per second.

    python -m benchmarks disagg                      # prompts 1-3.5k (tiny model), outputs 256, 0.5 requests/s
    python -m benchmarks disagg --smoke              # a small run (prompts 64-512, outputs 32)
    python -m benchmarks disagg --engine-flags "--default-model qwen3-0.6b --device cuda --dtype bfloat16" \\
        --kv-transfer-backend gloo                   # two engines sharing one GPU

Inter-token gaps are those a client sees between two streamed updates, split evenly over the
tokens of an update; TPOT is a request's (end - first token) / (tokens - 1)."""
from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_async import SamplingParams  # noqa: E402
from megatron_async.client import InferenceClient  # noqa: E402
from tests.helpers.coordinator_procs import TINY_ENGINE, Cluster  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks disagg", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="small defaults (flags given beside it win)")
    p.add_argument("--requests", type=int, default=None, help="arrivals (default 24; smoke 8)")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default 0.5; smoke 2)")
    p.add_argument("--min-prompt", type=int, default=None, help="default 1024; smoke 64")
    p.add_argument("--max-prompt", type=int, default=None,
                   help="default 8192 (3584 for the tiny model, whose positions end at 4096); smoke 512")
    p.add_argument("--output", type=int, default=None, help="tokens per request (default 256; smoke 32)")
    p.add_argument("--max-requests", type=int, default=8, help="each engine's request places")
    p.add_argument("--engine-flags", default=None, help="model / device flags of serve (default: the tiny model on CPU)")
    p.add_argument("--kv-transfer-backend", default=None, choices=["auto", "nccl", "gloo"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    small, full = dict(requests=8, rate=2.0, min_prompt=64, max_prompt=512, output=32), \
        dict(requests=24, rate=0.5, min_prompt=1024, max_prompt=8192 if args.engine_flags else 3584, output=256)
    for name, value in (small if args.smoke else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def arrivals(args) -> list[tuple[float, list[int]]]:
    rng = random.Random(args.seed)
    at, out = 0.0, []
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        out.append((at, [rng.randrange(1, 1000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]))
    return out


def engine_flags(args) -> tuple[tuple[str, ...], tuple[str, ...]]:
    model = tuple(shlex.split(args.engine_flags)) if args.engine_flags else tuple(TINY_ENGINE)
    blocks = args.max_requests * -(-(args.max_prompt + args.output) // 16) + 64
    flags = ("--block-size", "16", "--num-kv-blocks", str(blocks), "--max-requests", str(args.max_requests),
             "--max-sequence-length", str(args.max_prompt + args.output + 16), "--prefix-caching")
    return model, flags


async def drive(address: str, work, output: int) -> dict:
    params = SamplingParams(top_k=1, num_tokens_to_generate=output, ignore_eos=True)
    ttft, tpot, gaps, tokens = [], [], [], 0
    async with InferenceClient(address, timeout_s=120) as client:
        t0 = time.perf_counter()

        async def one(at: float, prompt: list[int]):
            nonlocal tokens
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            start = last = time.perf_counter()
            first, n = None, 0
            async for upd in client.add_request_streaming(prompt, params):
                now = time.perf_counter()
                k = len(upd.new_tokens)
                if not k:
                    continue
                if first is None:
                    first = now
                    ttft.append(now - start)
                else:
                    gaps.extend([(now - last) / k] * k)
                last, n = now, n + k
            tokens += n
            if n > 1:
                tpot.append((last - first) / (n - 1))

        await asyncio.gather(*(one(at, p) for at, p in work))
        seconds = time.perf_counter() - t0
    return {"ttft": ttft, "tpot": tpot, "gaps": gaps, "tok_s": tokens / seconds}


def run_setup(args, roles: tuple[str, ...], work) -> dict:
    model, flags = engine_flags(args)
    cluster = Cluster("load_balanced", timeout_s=400)
    try:
        for i, role in enumerate(roles):
            extra = ("--role", role) if role != "mixed" else ()
            if role != "mixed" and args.kv_transfer_backend:
                extra += ("--kv-transfer-backend", args.kv_transfer_backend)
            cluster.start_engine(f"e{i}", *flags, *extra, model=model)
        for i in range(len(roles)):
            cluster.wait_engine(f"e{i}")
        return asyncio.run(drive(cluster.address, work, args.output))
    finally:
        cluster.close()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv=None) -> None:
    args = parse_args(argv)
    work = arrivals(args)
    print(f"{args.requests} requests at {args.rate}/s, prompts {args.min_prompt}-{args.max_prompt}, "
          f"outputs {args.output}", flush=True)
    rows = [("DP=2 mixed", ("mixed", "mixed")), ("1 prefill + 1 decode", ("prefill", "decode"))]
    print("| setup | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | inter-token p50 ms | inter-token p99 ms | tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, roles in rows:
        r = run_setup(args, roles, work)
        ms = 1e3
        print(f"| {name} | {pct(r['ttft'], .5) * ms:.0f} | {pct(r['ttft'], .99) * ms:.0f} | "
              f"{statistics.median(r['tpot']) * ms:.1f} | {pct(r['gaps'], .5) * ms:.1f} | "
              f"{pct(r['gaps'], .99) * ms:.1f} | {r['tok_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
