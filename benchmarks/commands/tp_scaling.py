"""Tensor-parallel scaling of the decode step: the built-in Qwen3-8B shape (bf16, random weights)
at TP=1/2/4, each size one torchrun job on the same workload: B requests of --prompt-len random
tokens, --output-len greedy tokens each (all decode steps run at batch B), B in --batches.

Per TP size, all-reduce backend (NCCL; P2P symmetric memory; P2P with the all-reduce fused into
the next residual add + RMSNorm, "p2p+fused") and mode (serial + CUDA graphs;
async + CUDA graphs): the mean decode step (host time of decode-only engine steps: in steady
launch-ahead that is the device step), the per-rank bandwidth floor ((this rank's weights + the
KV it reads) / device copy bandwidth), step / floor, the ratio to TP=1's step (same mode and
batch), and the per-step consensus (ZMQ exchange) p50 / p99 in us from EngineStats. Graphs are
captured for exactly the --batches sizes (recaptured when the backend changes: a graph keeps
the path it captured).

    python -m benchmarks tp-scaling [--tp 1 2 4] [--batches 1 32 128] [--layers N] [--json F]
        [--backends nccl p2p p2p+fused] [--modes serial async]
    python -m benchmarks tp-scaling --smoke        # CPU, gloo, the tiny model: TP=1/2

Launches ``torchrun --standalone --nproc-per-node T`` per size (rank 0 writes a JSON result);
NVLink multicast stays off in every process. Prints one markdown table last."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.torchrun_job import run_torchrun  # noqa: E402

BACKENDS = ("nccl", "p2p", "p2p+fused")
SMOKE = ["--device", "cpu", "--model", "tiny", "--dtype", "float32", "--tp", "1", "2", "--batches", "1", "4",
         "--prompt-len", "8", "--output-len", "6"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--model", default="qwen3-8b", help="built-in model (megatron_async.models.default_model)")
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the model's (say so)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--launch-timeout", type=float, default=400.0, help="seconds per torchrun job")
    p.add_argument("--all-reduce", default="auto", choices=["auto", "nccl", "p2p"],
                   help="InferenceConfig.tp_all_reduce: auto / p2p time NCCL and the P2P path side by side")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS),
                   help="TP > 1 with a P2P reducer: which all-reduce paths to time (NCCL-only groups: nccl)")
    p.add_argument("--modes", nargs="+", default=["serial", "async"], choices=["serial", "async"])
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("--idle", action="store_true",
                   help="also profile one async + graphs run at the largest batch per backend: the device idle "
                        "share of its decode windows (CUPTI intervals, rank 0), i.e. whether host work and the "
                        "per-step consensus stay off the device's critical path")
    p.add_argument("--smoke", action="store_true", help="CPU / gloo / tiny model, TP=1 and 2: checks the script")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)  # set on torchrun workers
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args([*SMOKE, *(argv if argv is not None else sys.argv[1:])])  # flags given win
    return args


# ---------------------------------------------------------------- worker (one torchrun rank)

def _worker(args: argparse.Namespace) -> None:
    import torch

    from benchmarks.gpu_idle import profile_run
    from benchmarks.roofline import kv_bytes_per_token, measure_copy_bandwidth, weight_bytes
    from megatron_async import LLM, InferenceConfig, SamplingParams
    from megatron_async.inference.engines.engine_stats import EngineStats
    from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner
    from megatron_async.models.default_model import DEFAULT_CONFIGS

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    if args.layers is not None:
        DEFAULT_CONFIGS[args.model] = {**DEFAULT_CONFIGS[args.model], "num_hidden_layers": args.layers}
    cuda = args.device == "cuda"
    seq = args.prompt_len + args.output_len + 1
    blocks_per_req = -(-seq // 16)
    cfg = InferenceConfig(block_size_tokens=16, num_kv_blocks=max(args.batches) * (blocks_per_req + 1) + 8,
                          max_requests=max(args.batches), max_tokens=max(2048, max(args.batches)),
                          max_sequence_length=seq + 16, cuda_graphs=cuda, cuda_graph_batch_sizes=tuple(args.batches),
                          tp_all_reduce=args.all_reduce)
    t0 = time.perf_counter()
    llm = LLM(None, device=args.device, dtype=args.dtype, inference_config=cfg, default_model=args.model,
              tensor_parallel_size=tp)
    build_s = time.perf_counter() - t0
    leader = llm.is_leader
    try:
        vocab = llm.model.vocab_size
        prompts = [[(97 * i + 31 * j + 7) % (vocab - 1) + 1 for j in range(args.prompt_len)] for i in range(max(args.batches))]
        params = SamplingParams(top_k=1, num_tokens_to_generate=args.output_len, ignore_eos=True)
        bandwidth = measure_copy_bandwidth(llm.device)
        kv_token = kv_bytes_per_token(llm.model, llm.dtype)
        mean_ctx = args.prompt_len + args.output_len / 2
        reducer = llm.parallel.tp_reducer
        p2p_bytes = reducer.max_bytes if reducer is not None else 0
        fused_bytes = reducer.fused_max_bytes if reducer is not None else 0
        backends = ["-"] if tp == 1 else (args.backends if reducer is not None else ["gloo" if not cuda else "nccl"])
        if "p2p+fused" in backends and not fused_bytes:
            backends.remove("p2p+fused")  # the fused kernel is off (knob, TP size, or its self-test): say so below
        t1 = time.perf_counter()
        llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=4, ignore_eos=True))  # compile, NCCL
        result = {"tp": tp, "model": args.model, "layers": DEFAULT_CONFIGS[args.model]["num_hidden_layers"],
                  "device": torch.cuda.get_device_name(llm.device) if cuda else "cpu", "build_s": build_s,
                  "warmup_s": time.perf_counter() - t1, "weight_bytes": weight_bytes(llm.model),
                  "kv_bytes_per_token": kv_token, "copy_bandwidth": bandwidth, "p2p_reason": None, "rows": [],
                  "fused_norm_bytes": fused_bytes,
                  "idle": []}
        tokens_by_backend: dict[str, dict] = {}
        if leader:
            print(f"[tp={tp}] built in {build_s:.0f} s, warm-up {result['warmup_s']:.0f} s, backends {backends}", flush=True)
        for backend in backends:
            if reducer is not None:
                reducer.max_bytes = p2p_bytes if backend.startswith("p2p") else 0
                reducer.fused_max_bytes = fused_bytes if backend == "p2p+fused" else 0
            if cuda:  # graphs keep the all-reduce path they captured: capture anew for this backend
                llm.runner.graphs = CudaGraphRunner(llm.runner, llm.config.graph_sizing())
            for batch in args.batches:  # captures this step's graph at every batch size before timing
                llm.generate(prompts[:batch], SamplingParams(top_k=1, num_tokens_to_generate=3, ignore_eos=True))
            tokens = tokens_by_backend[backend] = {}
            for mode in args.modes:
                llm.engine.async_scheduling = mode == "async"
                for batch in args.batches:
                    llm.engine.stats = st = EngineStats()
                    calls = dict(reducer.calls) if reducer is not None else {}
                    t2 = time.perf_counter()
                    outs = llm.generate(prompts[:batch], params)
                    wall = time.perf_counter() - t2
                    tokens[(mode, batch)] = [o.generated_tokens for o in outs]
                    floor_s = (result["weight_bytes"] + kv_token * mean_ctx * batch) / bandwidth
                    result["rows"].append({
                        "backend": backend, "mode": f"{mode}+graphs" if cuda else mode, "batch": batch,
                        "decode_ms": st.mean_decode_step_ms, "decode_steps": st.decode_steps, "floor_ms": 1e3 * floor_s,
                        "consensus_p50_us": st.consensus_us(50), "consensus_p99_us": st.consensus_us(99),
                        "latency_p50_us": st.consensus_latency_us(50), "latency_p99_us": st.consensus_latency_us(99),
                        "consensus_rounds": st.consensus_rounds, "overlap": st.overlap_ratio,
                        "tok_s": batch * args.output_len / wall,
                        "p2p_calls": {k: v - calls.get(k, 0) for k, v in reducer.calls.items()} if reducer else {},
                        "async_equals_serial": (None if mode == "serial" or ("serial", batch) not in tokens
                                                else tokens[("serial", batch)] == tokens[(mode, batch)])})
                    if leader:
                        r = result["rows"][-1]
                        print(f"[tp={tp}] {backend:5s} {r['mode']:14s} batch {batch:4d}: decode {r['decode_ms']:.3f} ms "
                              f"(floor {r['floor_ms']:.3f}), consensus p50 {r['consensus_p50_us']:.0f} us "
                              f"(own cost {r['latency_p50_us']:.0f} us)", flush=True)
                        Path(args.worker_out).write_text(json.dumps(result))  # partial results survive a timeout
            if args.idle and cuda:  # every rank profiles its own device; rank 0 reports
                llm.engine.async_scheduling = True
                batch = max(args.batches)
                _, rep = profile_run(llm.engine, lambda: llm.generate(prompts[:batch], params))
                result["idle"].append({"backend": backend, "batch": batch, "decode_idle": rep.decode_idle_share,
                                       "run_idle": rep.run_idle_share, "note": rep.note})
                if leader:
                    print(f"[tp={tp}] {backend:5s} async+graphs batch {batch}: decode-window idle "
                          f"{rep.decode_idle_share}, run idle {rep.run_idle_share:.3f} {rep.note}", flush=True)
                    Path(args.worker_out).write_text(json.dumps(result))
        if "nccl" in tokens_by_backend:  # bf16: a different summation order may flip near-ties
            nccl = tokens_by_backend["nccl"]
            for r in result["rows"]:
                if r["backend"].startswith("p2p"):
                    key = (r["mode"].split("+")[0], r["batch"])
                    a, b = tokens_by_backend[r["backend"]][key], nccl[key]
                    r["requests_equal_to_nccl"] = sum(x == y for x, y in zip(a, b)) / len(a)
        result["p2p_calls_total"] = dict(reducer.calls) if reducer is not None else {}  # graphs count at capture
        if leader:
            Path(args.worker_out).write_text(json.dumps(result))
    finally:
        llm.close()


# ---------------------------------------------------------------- parent: one torchrun job per TP size

def _launch(args: argparse.Namespace, tp: int, out: Path, argv: list[str]) -> dict | None:
    status = run_torchrun(Path(__file__).resolve(), tp, [*argv, "--worker-out", str(out)], args.launch_timeout)
    print(f"[tp={tp}] {status}", flush=True)
    return json.loads(out.read_text()) if out.exists() else None


def table(results: list[dict]) -> str:
    base = {(r["mode"], r["batch"]): r["decode_ms"] for res in results if res["tp"] == 1 for r in res["rows"]}
    serial = {(res["tp"], r["backend"], r["batch"]): r["decode_ms"] for res in results for r in res["rows"]
              if r["mode"].startswith("serial")}
    lines = ["| TP | all-reduce | mode | batch | decode ms | floor ms | step / floor | vs TP=1 | async / serial "
             "| consensus p50 / p99 us | its own cost p50 / p99 us | tok/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            ref = base.get((r["mode"], r["batch"]))
            ser = serial.get((res["tp"], r["backend"], r["batch"]))
            ms = r["decode_ms"]
            speed = f"{ser / ms:.2f}x" if r["mode"].startswith("async") and ser and ms else ""
            vs_tp1 = f"{ms / ref:.2f}" if ref else ""
            lines.append(f"| {res['tp']} | {r['backend']} | {r['mode']} | {r['batch']} | {ms:.3f} | {r['floor_ms']:.3f} | "
                         f"{ms / r['floor_ms']:.2f} | {vs_tp1} | {speed} | "
                         f"{r['consensus_p50_us']:.0f} / {r['consensus_p99_us']:.0f} | "
                         f"{r.get('latency_p50_us', 0):.0f} / {r.get('latency_p99_us', 0):.0f} | {r['tok_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker_out is not None:
        _worker(args)
        return
    results, missing = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            res = _launch(args, tp, Path(tmp) / f"tp{tp}.json", argv)
            (results.append(res) if res else missing.append(tp))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "missing_tp": missing}, indent=1))
    rows = [r for res in results for r in res["rows"] if r["async_equals_serial"] is not None]
    print(f"async == serial tokens in {sum(r['async_equals_serial'] for r in rows)} of {len(rows)} async runs")
    same = [f"TP={res['tp']} {r['backend']} {r['mode']} b{r['batch']}: {r['requests_equal_to_nccl']:.0%}" for res in results
            for r in res["rows"] if "requests_equal_to_nccl" in r]
    if same:
        print("requests with P2P tokens == NCCL tokens: " + ", ".join(same))
    for res in results:
        print(f"TP={res['tp']} {res['model']} ({res['layers']} layers) on {res['device']}: weights/rank "
              f"{res['weight_bytes'] / 1e9:.2f} GB, copy {res['copy_bandwidth'] / 1e12:.2f} TB/s, build "
              f"{res['build_s']:.0f} s, warm-up {res['warmup_s']:.0f} s, fused all-reduce + norm up to "
              f"{res.get('fused_norm_bytes', 0) >> 10} KB, P2P calls {res.get('p2p_calls_total', {})}")
    print(table(results))
    for res in results:
        for r in res.get("idle", []):
            dec = "n/a" if r["decode_idle"] is None else f"{100 * r['decode_idle']:.1f} %"
            print(f"TP={res['tp']} {r['backend']} async+graphs batch {r['batch']}: device idle {dec} of decode windows, "
                  f"{100 * r['run_idle']:.1f} % of the profiled run {r['note']}")
    if missing:
        print(f"no result for TP={missing}")
        sys.exit(1)


if __name__ == "__main__":
    main()
