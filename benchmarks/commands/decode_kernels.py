#!/usr/bin/env python
"""Per-kernel device time of steady decode steps (async + CUDA graphs by default), greedy and
sampled: a torch.profiler kernel table (name, count, total us, us per step, share) and the
same grouped by role (attention, GEMMs, norms, sampler, ...), to find each role's gap to its floor.

    python -m benchmarks decode-kernels --batch 128 --prompt-len 512 --steps 20
    python -m benchmarks decode-kernels --batch-invariant    # where the batch-invariant mode's decode goes
    python -m benchmarks decode-kernels --model qwen3-8b --batch 32 --prompt-len-min 8000 --prompt-len 16000 \
        --quantization fp8 --kv-cache-dtype fp8              # FP8 decode at long context
    python scripts/make_hybrid_checkpoint.py /tmp/nh_small && \
        python -m benchmarks decode-kernels --checkpoint /tmp/nh_small   # the hybrid (Mamba2) decode step

The batch's requests all arrive at once; after prefill and a few warm decode steps (graph
capture, Triton builds) ``--steps`` decode-only steps run under the profiler (CUDA activity only).
``--mixed`` profiles the prefill / mixed steps instead: a first batch of the same shape runs to
its end (every kernel built, every graph captured), then the second batch's steps up to its
first decode-only step run under the profiler.

Under ``torchrun --nproc-per-node N`` the model runs tensor-parallel over the N ranks (decode
profile only); rank 0 adds the requests and prints its own device's table.

    torchrun --nproc-per-node 2 python -m benchmarks decode-kernels --model qwen3-8b --batch 64"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import random
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_idle import union_length
from megatron_async import LLM, InferenceConfig, SamplingParams

GROUPS = [  # (role, name substrings), first match wins
    ("all-reduce (TP)", ("all_reduce", "allreduce", "nccl", "_fused_kernel", "symm_mem", "multimem")),
    ("sampler", ("_stats_kernel", "_draw_kernel", "_pick_kernel", "_stage_init", "_level_pass", "_level_update",
                 "_finish_kernel", "_penalty_kernel")),
    ("Mamba conv / SSM state", ("_state_update", "_conv_update", "_conv_out", "_conv_rows", "ssd", "mamba", "_scan",
                                "_chunk")),
    ("attention", ("attention", "attn", "_paged", "decode_kernel", "_decode_split", "_decode_merge",
                   "_prefill_kernel")),
    ("kv append", ("kv_append", "append")),
    ("norm / rope / act", ("rmsnorm", "rms_norm", "rope", "silu", "relu", "act", "norm")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "wgmma", "cublas", "_grouped_kernel",
              "_gate_up", "_down_kernel", "_down_fp8_kernel")),  # the routed experts' Triton GEMMs
    ("argmax / reductions", ("argmax", "reduce", "max_", "cumsum", "sort")),
    ("copies / casts", ("copy", "cast", "elementwise", "fill", "index", "gather", "scatter", "memcpy", "memset")),
]


def role(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def kernel_rows(prof) -> list[tuple[str, int, float]]:
    rows = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            r = rows[ev.name]
            r[0] += 1
            r[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return sorted(((n, c, t) for n, (c, t) in rows.items()), key=lambda x: -x[2])


def busy_us(prof) -> float:
    """Device time with at least one kernel running: the union of the kernels' intervals (their
    summed times count overlapping kernels twice, e.g. another stream's or a dependent launch's)."""
    return union_length([(ev.time_range.start, ev.time_range.end) for ev in prof.events()
                         if ev.device_type == torch.autograd.DeviceType.CUDA])


def host_side(llm: LLM, steps: int) -> tuple[float, str]:
    """Wall ms per decode step (no profiler; launch-ahead keeps one step in flight, so the
    cadence is max(host, device)), and a cProfile table of the host's work in as many steps."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        llm.engine.step()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    table = out.getvalue()
    return wall_ms, table[table.find("   ncalls"):]


def run(args, sampled: bool) -> None:
    n_out = args.warm_steps + 3 * args.steps + 8  # every request still decoding in the profiled steps
    # the longest request must fit (a request beyond max_sequence_length is refused at add_request)
    extra = {"max_sequence_length": args.max_sequence_length or max(InferenceConfig.max_sequence_length,
                                                                    args.prompt_len + n_out)}
    cfg = InferenceConfig(max_requests=args.batch, max_tokens=args.max_tokens or max(4096, args.batch),
                          buffer_size_gb=args.kv_gb, **extra,  # None: the profiled pool
                          async_scheduling=not args.serial, cuda_graphs=not args.eager, attention_backend="triton",
                          batch_invariant=args.batch_invariant, kv_cache_dtype=args.kv_cache_dtype,
                          split_linear=args.split_linear, moe_grouped_mm=args.moe_grouped_mm,
                          moe_triton_grouped_gemm=args.moe_triton_grouped_gemm)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    if tp > 1 and args.mixed:
        raise SystemExit("--mixed profiles one process; the tensor-parallel profile is of decode steps")
    llm = LLM(model=args.checkpoint, device="cuda", dtype="bfloat16", default_model=args.model, inference_config=cfg,
              tensor_parallel_size=tp, quantization=args.quantization)
    say = print if llm.is_leader else (lambda *a, **k: None)
    rng = random.Random(0)

    def add_batch() -> None:  # under TP the leader's requests reach the other ranks in the step's consensus
        for i in range(args.batch if llm.is_leader else 0):
            sp = (SamplingParams(temperature=0.8, top_p=0.95, seed=i, ignore_eos=True, num_tokens_to_generate=n_out)
                  if sampled else SamplingParams(top_k=1, ignore_eos=True, num_tokens_to_generate=n_out))
            n = rng.randint(args.prompt_len_min, args.prompt_len) if args.prompt_len_min else args.prompt_len
            llm.engine.add_request([rng.randrange(llm.model.vocab_size) for _ in range(n)], sp)

    add_batch()
    if args.mixed:
        mixed_profile(llm, add_batch, sampled)
        return
    while llm.engine.stats.decode_steps == 0:  # every prefill chunk (stats count launches: the first
        llm.engine.step()                        # decode-only launch comes after the last chunk)
    for _ in range(args.warm_steps):  # graph replays settle; the profile must hold decode steps only
        llm.engine.step()
    torch.cuda.synchronize()
    before = (llm.engine.stats.decode_steps, llm.engine.stats.prefill_steps)
    rows = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            rows.append(llm.engine.step().num_rows)
        torch.cuda.synchronize()
    got = (llm.engine.stats.decode_steps - before[0], llm.engine.stats.prefill_steps - before[1])
    assert got == (args.steps, 0), f"profiled {got[0]} decode and {got[1]} prefill / mixed steps, not {args.steps} decode"
    st = llm.engine.stats
    assert st.paused == st.evicted == 0, f"the KV pool held only part of the batch ({st.paused} pauses): raise --kv-gb"
    mean_rows = sum(rows) / len(rows)
    rows = kernel_rows(prof)
    busy_ms = busy_us(prof) / args.steps / 1e3
    wall_ms, host = host_side(llm, args.steps)
    label = "sampled (temperature 0.8, top-p 0.95)" if sampled else "greedy"
    # rows below the batch: the pool admitted only part of it before the first decode-only step
    # (the rest still waits), so the profile is of a smaller batch than asked
    say(f"\n### {label}: batch {args.batch} ({mean_rows:.1f} rows a profiled step), {args.steps} decode steps, "
        f"TP={tp} (rank 0's device), device busy "
        f"{busy_ms:.3f} ms per step; wall {wall_ms:.3f} ms per step without the profiler (device busy / wall "
        f"{busy_ms / wall_ms:.0%})")
    say(f"\nhost, cProfile of {args.steps} more steps (top by own time):\n```\n{host}```")
    if llm.is_leader:
        print_roles(rows, args.steps, args.top)
    llm.close()  # its graphs first: main() collects the rest before the next workload's memory plan


def print_roles(rows, steps: int, top: int) -> None:
    total = sum(t for _, _, t in rows)
    print("\n| role | us per step | share |\n|---|---:|---:|")
    by_role = defaultdict(float)
    for n, _, t in rows:
        by_role[role(n)] += t
    for r, t in sorted(by_role.items(), key=lambda x: -x[1]):
        print(f"| {r} | {t / steps:.1f} | {t / total:.1%} |")
    print("\n| kernel | role | count | total us | us per step | share |\n|---|---|---:|---:|---:|---:|")
    for n, c, t in rows[:top]:
        print(f"| `{n[:70]}` | {role(n)} | {c} | {t:.0f} | {t / steps:.1f} | {t / total:.1%} |")


def mixed_profile(llm: LLM, add_batch, sampled: bool) -> None:
    """The prefill / mixed steps of a second batch, after a first one warmed every kernel."""
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    add_batch()
    st = llm.engine.stats
    before = (st.decode_steps, st.prefill_steps)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while st.decode_steps == before[0]:
            llm.engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    steps = st.prefill_steps - before[1]
    rows = kernel_rows(prof)
    busy_ms = busy_us(prof) / 1e3
    label = "sampled (temperature 0.8, top-p 0.95)" if sampled else "greedy"
    print(f"\n### {label}: prefill / mixed steps of {llm.engine.config.max_tokens}-token chunks: {steps} steps "
          f"(+1 decode launch), device busy {busy_ms / steps:.3f} ms per step, wall {wall_ms / steps:.3f} ms per step "
          f"under the profiler")
    print_roles(rows, steps, 30)
    llm.close()  # its graphs first: main() collects the rest before the next workload's memory plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="built-in default model name")
    p.add_argument("--checkpoint", default=None, help="an HF checkpoint directory instead of --model (e.g. the hybrid "
                   "one scripts/make_hybrid_checkpoint.py writes)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prompt-len-min", type=int, default=0, help="ragged prompts: lengths uniform in [min, --prompt-len]")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="default: the longest prompt and its profiled tokens (at least InferenceConfig's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warm-steps", type=int, default=12)
    p.add_argument("--kv-gb", type=float, default=None,
                   help="KV pool (default: as the benchmark, sized from profiled memory; a pool too small for the "
                        "whole batch pauses rows and the profile fails)")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--mixed", action="store_true", help="profile the prefill / mixed steps instead of decode")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per step (default max(4096, batch); "
                   "the benchmark's GPU default is 8192)")
    p.add_argument("--serial", action="store_true", help="no launch-ahead")
    p.add_argument("--batch-invariant", action="store_true", help="the batch-invariant mode's kernels")
    p.add_argument("--quantization", choices=["fp8"], default=None, help="FP8 weights")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's) or fp8 (e4m3 pool)")
    for switch in ("split_linear", "moe_grouped_mm", "moe_triton_grouped_gemm"):  # A/B of a kernel path
        p.add_argument(f"--no-{switch.replace('_', '-')}", dest=switch, action="store_false",
                       help=f"InferenceConfig.{switch}=False")
    p.add_argument("--workloads", default="greedy,sampled")
    args = p.parse_args()
    if int(os.environ.get("RANK", "0")) == 0:
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for w in args.workloads.split(","):
        run(args, sampled=w.strip() == "sampled")
        gc.collect()  # an engine's reference cycles would hold its pools into the next one's memory plan
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
