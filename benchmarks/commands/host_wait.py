"""How the engine thread waits for a launch's samples: spinning (a core polls the device) or
blocking (the thread sleeps until the device signals), side by side on one engine: output tok/s,
decode step and the CPU the process and the engine thread burn.

``ModelRunner.host_wait``: "spin" everywhere (cudaEventSynchronize's default), "block"
everywhere, or the default (None, "auto" here): block on launches made ahead of the previous
step's bookkeeping (another launch is queued behind the one waited for, so waking a few tens of
microseconds later idles nothing), spin on the others (serial steps, a chain's first launch).
Workload A's shape (128 requests, prompts 100-1,024, 128 greedy outputs, CUDA graphs); every
cell runs once untimed, then the cells interleaved ``--repeats`` times, medians.

    python -m benchmarks host-wait                 # one GPU, ~3 minutes on an H100
    python -m benchmarks host-wait --smoke         # CPU, tiny model (no events: the modes are equal)
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.cli.driver import StatsWindow  # noqa: E402

MODES = {"spin": "spin", "auto": None, "block": "block"}


def run_cell(llm: LLM, mode: str, prompts, params) -> dict:
    llm.runner.host_wait = MODES[mode]
    window = StatsWindow(llm.engine)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0, cpu0, thread0 = time.perf_counter(), time.process_time(), time.thread_time()
    outs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    st = window.stats()
    return {"tok_s": sum(len(o.generated_tokens) for o in outs) / wall, "decode_ms": st.mean_decode_step_ms,
            "process_cores": (time.process_time() - cpu0) / wall, "engine_cores": (time.thread_time() - thread0) / wall,
            "tokens": [o.generated_tokens for o in outs]}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    n, lo, hi, out_len = (args.num_requests, 100, 1024, 128) if cuda else (8, 8, 24, 8)
    cfg = InferenceConfig(max_requests=n, max_tokens=8192 if cuda else 64) if cuda else InferenceConfig(max_requests=n)
    llm = LLM(None, "cuda" if cuda else "cpu", "bfloat16" if cuda else "float32", cfg,
              default_model="qwen3-0.6b" if cuda else "tiny")
    rng = random.Random(0)
    prompts = [[rng.randrange(llm.model.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    params = SamplingParams(top_k=1, num_tokens_to_generate=out_len, ignore_eos=True)
    for mode in args.modes:  # untimed
        run_cell(llm, mode, prompts, params)
    cells: dict[str, list[dict]] = {m: [] for m in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:
            cells[mode].append(run_cell(llm, mode, prompts, params))
    ref = cells[args.modes[0]][0]["tokens"]
    same = all(c["tokens"] == ref for cs in cells.values() for c in cs)
    med = {m: {k: statistics.median(c[k] for c in cs) for k in ("tok_s", "decode_ms", "process_cores", "engine_cores")}
           for m, cs in cells.items()}
    base = med[args.modes[0]]
    print(f"host-wait: {'qwen3-0.6b bf16, CUDA graphs' if cuda else 'tiny, CPU'}, {n} requests, prompts {lo}-{hi}, "
          f"{out_len} greedy outputs, medians of {args.repeats}; tokens equal in every cell: {same}")
    print(f"| wait | out tok/s | x {args.modes[0]} | decode ms | process CPU (cores) | engine thread CPU (cores) |")
    print("|---|---:|---:|---:|---:|---:|")
    for m, r in med.items():
        print(f"| {m} | {r['tok_s']:,.0f} | {r['tok_s'] / base['tok_s']:.3f} | {r['decode_ms']:.2f} | "
              f"{r['process_cores']:.2f} | {r['engine_cores']:.2f} |")
    return med


if __name__ == "__main__":
    main()
