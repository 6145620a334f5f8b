"""Where a tensor-parallel decode step goes, kernel by kernel: the built-in model (bf16, random
weights) at TP=N, --batch requests of --prompt-len tokens (default one of 32), greedy, async + CUDA
graphs, the profiled prompts found in the prefix cache (one prefill step of a token a request,
then decode steps of the whole batch); each variant one torchrun job. Every
rank profiles --steps decode steps (torch profiler, CUDA activity: the kernels of the graph
replays as the device ran them) and reports its mean decode step, kernels a step, the gaps
between them, the time inside the step's plain one- / two-shot all-reduces (the embedding's, the first
collective of a step: it absorbs the ranks' skew at the step's start) and its consensus
percentiles; rank 0 also lists its kernels by time a step.

Variants: "default"; "no-split" (``split_linear=False``: a TP rank's decode-size o_proj /
down_proj / qkv on cuBLAS's split-K GEMM and its reduce kernel instead of handing K-split
partials to the fused all-reduce + RMSNorm / the q/k norm + rope); "unfused" (``tp_fused_norm=False``).

    python -m benchmarks tp-kernels --tp 4 [--variants default no-split] [--model qwen3-8b] [--steps 32]
        [--batch 1] [--prompt-len 32]

CUDA only; NVLink multicast stays off in every process. Prints one table last."""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.torchrun_job import run_torchrun  # noqa: E402

_PLAIN_ALL_REDUCE = re.compile(r"(one|two)_shot_all_reduce")
"""torch's symmetric-memory all-reduce kernels (two-shot above 512 KB: the embedding's at 128 rows)."""
VARIANTS = {"default": {}, "no-split": {"split_linear": False}, "unfused": {"tp_fused_norm": False}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--variants", nargs="+", default=["default", "no-split"], choices=list(VARIANTS))
    p.add_argument("--model", default="qwen3-8b", help="built-in model (megatron_async.models.default_model)")
    p.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens of each prompt")
    p.add_argument("--top", type=int, default=16, help="rank 0's kernels listed")
    p.add_argument("--launch-timeout", type=float, default=240.0, help="seconds per torchrun job")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # set on torchrun workers
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _kernels(prof) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from megatron_async import LLM, InferenceConfig, SamplingParams
    from megatron_async.inference.engines.engine_stats import EngineStats

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    seq = args.prompt_len + 2 * args.steps + 64
    cfg = InferenceConfig(block_size_tokens=16, num_kv_blocks=args.batch * (seq // 16 + 2) + 64,
                          max_requests=max(8, args.batch), max_tokens=max(2048, args.batch * args.prompt_len),
                          max_sequence_length=seq, cuda_graphs=True, cuda_graph_batch_sizes=(args.batch,),
                          enable_prefix_caching=True, **VARIANTS[args.variant])  # the profiled prompts: cache hits
    llm = LLM(None, device="cuda", dtype="bfloat16", inference_config=cfg, default_model=args.model,
              tensor_parallel_size=tp)
    try:
        prompt = [[(31 * j + 7 * i) % 1000 + 1 for j in range(args.prompt_len)] for i in range(1, args.batch + 1)]
        llm.generate(prompt, SamplingParams(top_k=1, num_tokens_to_generate=8, ignore_eos=True))  # captures, builds
        llm.engine.stats = st = EngineStats()
        params = SamplingParams(top_k=1, num_tokens_to_generate=args.steps, ignore_eos=True)
        llm.generate(prompt, params)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt, params)
        ev, n = _kernels(prof), args.steps
        gaps = [max(0.0, b["ts"] - a["ts"] - a["dur"]) for a, b in zip(ev, ev[1:])]
        rank = dist.get_rank() if dist.is_initialized() else 0
        out = {"rank": rank, "step_ms": st.mean_decode_step_ms, "kernels": len(ev) / n, "gaps_us": sum(gaps) / n,
               "first_all_reduce_us": sum(e["dur"] for e in ev if _PLAIN_ALL_REDUCE.search(e["name"])) / n,
               "consensus_us": (st.consensus_us(50), st.consensus_us(99)), "top": []}
        if rank == 0:
            by_name = collections.defaultdict(lambda: [0.0, 0])
            for e in ev:
                by_name[e["name"][:80]][0] += e["dur"]
                by_name[e["name"][:80]][1] += 1
            out["top"] = [(name, d / n, c / n) for name, (d, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])]
        Path(f"{args.worker_out}.{rank}").write_text(json.dumps(out))
    finally:
        llm.close()


def _launch(args: argparse.Namespace, variant: str, out: Path, argv: list[str]) -> list[dict]:
    status = run_torchrun(Path(__file__).resolve(), args.tp, [*argv, "--variant", variant, "--worker-out", str(out)],
                          args.launch_timeout)
    print(f"[{variant}] {status}", flush=True)
    found = [Path(f"{out}.{r}") for r in range(args.tp)]
    return [json.loads(p.read_text()) for p in found if p.exists()]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker_out is not None:
        _worker(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            results[variant] = sorted(_launch(args, variant, Path(tmp) / variant, argv), key=lambda r: r["rank"])
    for variant, ranks in results.items():
        top = next((r["top"] for r in ranks if r["rank"] == 0), [])
        print(f"\n{variant}: rank 0's kernels, us a step (count a step)")
        for name, us, count in top[:args.top]:
            print(f"  {us:8.1f}  ({count:5.1f})  {name}")
    print("\n| variant | rank | decode step ms | kernels a step | gaps us a step | first all-reduce us a step "
          "| consensus p50 / p99 us |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for variant, ranks in results.items():
        if not ranks:
            print(f"| {variant} | - | no result | | | | |")
        for r in ranks:
            print(f"| {variant} | {r['rank']} | {r['step_ms']:.3f} | {r['kernels']:.0f} | {r['gaps_us']:.0f} | "
                  f"{r['first_all_reduce_us']:.1f} | {r['consensus_us'][0]:.0f} / {r['consensus_us'][1]:.0f} |")


if __name__ == "__main__":
    main()
