"""Prefill / decode disaggregation against data parallelism: the same arrivals (Poisson at
``--rate``, prompts of ``--min-prompt``..``--max-prompt`` tokens, ``--output`` tokens each, all
streamed) through DP=2 mixed engines and through 1 prefill + 1 decode engine behind one
coordinator, each engine a process of its own; one table: TTFT, TPOT, inter-token gaps p50 / p99,
output tokens per second; then the KV transfers' own time and bytes per request against a plain
copy of as many bytes (GPU to GPU, or host memory on the CPU).

    python -m benchmarks disagg                      # the tiny model on the CPU: prompts 1-3.5k, outputs 256
    python -m benchmarks disagg --smoke              # a small run (prompts 64-512, outputs 32)
    python -m benchmarks disagg --device cuda        # qwen3-0.6b, engine 0 on GPU 0 and engine 1 on GPU 1
    python -m benchmarks disagg --device cuda --gpus 0 0 --kv-transfer-backend ipc   # both on one GPU

On CUDA each engine process sees every GPU, its own first (``CUDA_VISIBLE_DEVICES`` reordered):
it runs on ``cuda:0`` and still reaches its peer's GPU (CUDA IPC maps the peer's memory; NCCL
finds it by bus id). Inter-token gaps are those a client sees between two streamed updates,
split evenly over the tokens of an update; TPOT is a request's (end - first token) / (tokens - 1)."""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_async import SamplingParams  # noqa: E402
from megatron_async.client import InferenceClient  # noqa: E402
from megatron_async.disaggregation.loop_times import PARTS  # noqa: E402
from tests.helpers.coordinator_procs import TINY_ENGINE, Cluster  # noqa: E402


GPU_MODEL = ("--default-model", "qwen3-0.6b", "--device", "cuda", "--dtype", "bfloat16", "--cuda-graphs")
SIZES = {  # (the flags left unset take these)
    "smoke": dict(requests=8, rate=2.0, min_prompt=64, max_prompt=512, output=32, max_requests=8),
    "cpu": dict(requests=24, rate=0.5, min_prompt=1024, max_prompt=3584, output=256, max_requests=8),
    "cuda": dict(requests=96, rate=6.0, min_prompt=2048, max_prompt=8192, output=256, max_requests=64),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks disagg", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="small defaults (flags given beside it win)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: qwen3-0.6b (bf16, CUDA graphs), each engine on the GPU --gpus names")
    p.add_argument("--gpus", type=int, nargs=2, default=[0, 1], metavar=("FIRST", "SECOND"),
                   help="the visible GPUs of engine 0 (mixed / prefill) and engine 1 (mixed / decode); "
                        "one GPU twice: they share it")
    p.add_argument("--requests", type=int, default=None, help="arrivals (default cpu 24, cuda 96; smoke 8)")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default cpu 0.5, cuda 6; smoke 2)")
    p.add_argument("--min-prompt", type=int, default=None, help="default cpu 1024, cuda 2048; smoke 64")
    p.add_argument("--max-prompt", type=int, default=None,
                   help="default cuda 8192, cpu 3584 (the tiny model's positions end at 4096); smoke 512")
    p.add_argument("--output", type=int, default=None, help="tokens per request (default 256; smoke 32)")
    p.add_argument("--max-requests", type=int, default=None, help="each engine's request places (cpu 8, cuda 64)")
    p.add_argument("--engine-flags", default=None,
                   help="model / device flags of serve (default: the tiny model on the CPU; qwen3-0.6b on CUDA)")
    p.add_argument("--kv-transfer-backend", default=None, choices=["auto", "nccl", "gloo", "ipc"])
    p.add_argument("--pd-variant", action="append", dest="pd_variants", metavar="FLAGS",
                   help="repeatable: one 1 prefill + 1 decode row each, with these extra serve flags on both "
                        "engines; '--pd-variant= --pd-variant=--kv-send-mid-step' is an A/B in one run "
                        "(default: one row, no extra flags)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.pd_variants = args.pd_variants or [""]
    for name, value in SIZES["smoke" if args.smoke else args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "cuda" and args.gpus[0] == args.gpus[1] and args.kv_transfer_backend in (None, "auto", "nccl"):
        p.error("two engines on one GPU cannot form a NCCL group: --kv-transfer-backend gloo or ipc")
    return args


def arrivals(args) -> list[tuple[float, list[int]]]:
    rng = random.Random(args.seed)
    at, out = 0.0, []
    for _ in range(args.requests):
        at += rng.expovariate(args.rate)
        out.append((at, [rng.randrange(1, 1000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]))
    return out


def engine_flags(args) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if args.engine_flags:
        model = tuple(shlex.split(args.engine_flags))
    else:
        model = GPU_MODEL if args.device == "cuda" else tuple(TINY_ENGINE)
    flags = ("--block-size", "16", "--max-requests", str(args.max_requests),
             "--max-sequence-length", str(args.max_prompt + args.output + 16), "--prefix-caching")
    if args.device == "cpu":  # (on CUDA the memory planner sizes the pool)
        flags += ("--num-kv-blocks", str(args.max_requests * -(-(args.max_prompt + args.output) // 16) + 64))
    return model, flags


def visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def own_gpu_first(own: int) -> dict:
    """An engine process's environment for GPU ``own`` of this process's visible GPUs: every one
    visible, its own first (it runs on cuda:0; CUDA IPC maps a peer's memory)."""
    gpus = visible_gpus()
    if own >= len(gpus):
        raise SystemExit(f"GPU {own} named, but {len(gpus)} are visible")
    return {"CUDA_VISIBLE_DEVICES": ",".join([gpus[own]] + [g for i, g in enumerate(gpus) if i != own])}


def placement(args, engine: int) -> dict:
    """Engine ``engine``'s environment: its ``--gpus`` entry first (``own_gpu_first``)."""
    return own_gpu_first(args.gpus[engine]) if args.device == "cuda" else {}


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
        by_engine = (await client.engine_stats())["engines"]
        roles = {str(e["index"]): e.get("role", "mixed") for e in (await client.engines())["engines"]}
    stats = by_engine.values()
    moved = {k: sum(s.get(k, 0) for s in stats) for k in ("kv_transfers", "kv_transfer_bytes", "kv_transfer_seconds")}
    loops = [(roles.get(i, "?"), s) for i, s in sorted(by_engine.items())]
    return {"ttft": ttft, "tpot": tpot, "gaps": gaps, "tok_s": tokens / seconds, "loops": loops, **moved}


def run_setup(args, roles: tuple[str, ...], work, variant: str = "") -> dict:
    model, flags = engine_flags(args)
    flags += tuple(shlex.split(variant))
    cluster = Cluster("load_balanced", timeout_s=400)
    shared = args.device == "cuda" and args.gpus[0] == args.gpus[1]
    try:
        for i, role in enumerate(roles):
            extra = ("--role", role) if role != "mixed" else ()
            if role != "mixed" and args.kv_transfer_backend:
                extra += ("--kv-transfer-backend", args.kv_transfer_backend)
            if shared:  # (each its share of one GPU, the second sized after the first)
                extra += ("--gpu-memory-utilization", ("0.4", "0.8")[i])
            cluster.start_engine(f"e{i}", *flags, *extra, model=model, env=placement(args, i))
            if shared:
                cluster.wait_engine(f"e{i}")
        for i in range(len(roles)):
            if not shared:
                cluster.wait_engine(f"e{i}")
        return asyncio.run(drive(cluster.address, work, args.output))
    finally:
        cluster.close()


def plain_copy_seconds(args, nbytes: int, repeats: int = 20) -> tuple[float, str]:
    """The median time of one plain copy of ``nbytes`` where the transfers went (engine 0's GPU
    to engine 1's, or host memory to host memory), and its name."""
    import torch

    if args.device == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{args.gpus[0]}")
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{args.gpus[1]}")
        what = f"cuda:{args.gpus[0]} -> cuda:{args.gpus[1]}"
    else:
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        what = "host memory"
    times = []
    for i in range(repeats + 3):
        if src.is_cuda:
            torch.cuda.synchronize(src.device)
            torch.cuda.synchronize(dst.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize(dst.device)
            torch.cuda.synchronize(src.device)
        if i >= 3:  # (the first ones set up peer access)
            times.append(time.perf_counter() - t0)
    return statistics.median(times), what


def transfer_line(args, r: dict) -> str:
    n = r["kv_transfers"]
    if not n:
        return "KV transfers: none counted"
    per_bytes, per_s = r["kv_transfer_bytes"] / n, r["kv_transfer_seconds"] / n
    copy_s, what = plain_copy_seconds(args, int(per_bytes))
    backend = args.kv_transfer_backend or "auto"
    return (f"KV transfer ({backend}): {n} transfers, {per_bytes / 2**20:.1f} MiB and "
            f"{per_s * 1e3:.2f} ms per request ({per_bytes / per_s / 1e9:.1f} GB/s); a plain copy of as many bytes "
            f"({what}) {copy_s * 1e3:.2f} ms ({per_bytes / copy_s / 1e9:.1f} GB/s): "
            f"transfer / copy = {per_s / copy_s:.2f}")


def _parts(s: dict, which: str) -> str:
    """The hand-off loop's parts (disaggregation/loop_times.py) of ``which`` ("longest": the
    longest turn's; "max": each part's longest), in ms, the largest first."""
    parts = {name: 1e3 * s.get(f"kv_loop_{which}_{name}_seconds", 0.0) for name in PARTS}
    return " ".join(f"{name} {ms:.2f}" for name, ms in sorted(parts.items(), key=lambda p: -p[1]) if ms >= 0.01) or "-"


def loop_lines(r: dict) -> list[str]:
    """Per engine of the disaggregated setup: its steps, what its loop spent on hand-off work,
    what its longest hand-off turn spent its time on, its kv messages (their mean and longest:
    a one-off turn against steady work), the kv_sends it started while a step ran, and its
    one-time set-up."""
    out = ["| engine | steps | decode step ms | hand-off loop ms / step | longest hand-off turn ms | imports | "
           "import posted -> admitted ms mean / p50 / p99 | longest turn's parts ms | each part's longest ms | "
           "kv messages: mean / longest ms | kv_sends mid-step | kernel warm-up ms | connection set-up ms | "
           "gc full collections / longest pause ms |",
           "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for role, s in r["loops"]:
        steps, imports = s.get("steps", 0), s.get("kv_imports_landed", 0)
        decode = 1e3 * s.get("decode_wall_time", 0.0) / max(1, s.get("decode_steps", 0))
        messages = s.get("kv_loop_messages", 0)
        out.append(f"| {role} | {steps} | {decode:.2f} | {1e3 * s.get('kv_loop_seconds', 0.0) / max(1, steps):.3f} | "
                   f"{1e3 * s.get('kv_loop_max_seconds', 0.0):.2f} | {imports} | "
                   f"{1e3 * s.get('kv_import_seconds', 0.0) / max(1, imports):.2f} / "
                   f"{1e3 * s.get('kv_import_p50_seconds', 0.0):.2f} / "
                   f"{1e3 * s.get('kv_import_p99_seconds', 0.0):.2f} | "
                   f"{_parts(s, 'longest')} | {_parts(s, 'max')} | "
                   f"{1e3 * s.get('kv_loop_total_message_seconds', 0.0) / max(1, messages):.3f} / "
                   f"{1e3 * s.get('kv_loop_max_message_seconds', 0.0):.2f} | {s.get('kv_sends_mid_step', 0)} | "
                   f"{1e3 * s.get('kv_warmup_seconds', 0.0):.0f} | {1e3 * s.get('kv_connect_max_seconds', 0.0):.0f} | "
                   f"{s.get('gc_full_collections', 0)} / {1e3 * s.get('gc_pause_max_seconds', 0.0):.1f} |")
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv=None) -> None:
    args = parse_args(argv)
    work = arrivals(args)
    where = f"GPUs {args.gpus[0]} and {args.gpus[1]}" if args.device == "cuda" else "the CPU"
    print(f"{args.requests} requests at {args.rate}/s, prompts {args.min_prompt}-{args.max_prompt}, "
          f"outputs {args.output}, {args.max_requests} request places per engine, engines on {where}", flush=True)
    rows = [("DP=2 mixed", ("mixed", "mixed"), "")]
    rows += [(f"1 prefill + 1 decode{' ' + v if v else ''}", ("prefill", "decode"), v) for v in args.pd_variants]
    print("| setup | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | inter-token p50 ms | inter-token p99 ms "
          "| tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    disaggregated = []
    for name, roles, variant in rows:
        r = run_setup(args, roles, work, variant)
        if roles[0] == "prefill":
            disaggregated.append((name, r))
        ms = 1e3
        print(f"| {name} | {pct(r['ttft'], .5) * ms:.0f} | {pct(r['ttft'], .99) * ms:.0f} | "
              f"{statistics.median(r['tpot']) * ms:.1f} | {pct(r['tpot'], .99) * ms:.1f} | "
              f"{pct(r['gaps'], .5) * ms:.1f} | "
              f"{pct(r['gaps'], .99) * ms:.1f} | {r['tok_s']:.0f} |", flush=True)
    for name, r in disaggregated:  # (their engines closed: the plain copy has the GPUs to itself)
        print(f"\n{name}:", flush=True)
        print("\n".join(loop_lines(r)), flush=True)
        print(transfer_line(args, r), flush=True)


if __name__ == "__main__":
    main()
