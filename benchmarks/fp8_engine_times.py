"""The engine in bf16, with FP8 weights and with the FP8 KV cache, side by side in one process
(``python -m benchmarks fp8 engine``): the KV tokens the memory plan gives each, batch-1 decode
(512 in / 256 out), workload A (128 requests, prompts 100-1,024, 128 out, async + CUDA graphs) with
its decode step against the weight + KV read floor and its mixed step against the mixed floor (FLOPs + bytes),
and optionally the long-context workload (32 requests of 8-16k-token prompts, 64 out: its tok/s, mostly
prefill, its decode step and the step's mean rows; its "x bf16" is bf16's decode time per row over
this one's: a bf16 pool holds fewer of these requests at once, so its decode steps carry fewer rows)."""
from __future__ import annotations

import time

import torch

from benchmarks.own_process import in_own_process
from benchmarks.roofline import (decode_floor, mean_context_per_output_token, measure_copy_bandwidth, mixed_floor,
                                prefill_flops)
from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.cli.driver import StatsWindow, run_workload
from megatron_async.cli.summary import summarize
from megatron_async.cli.workload import WorkloadRequest, WorkloadSpec, synthetic_workload
from megatron_async.models.default_model import DEFAULT_CONFIGS

CONFIGS = {"bf16": (None, "auto"), "fp8": ("fp8", "auto"), "fp8+kv": ("fp8", "fp8_e4m3"), "kv": (None, "fp8_e4m3")}
"""name -> (quantization, kv_cache_dtype)."""


def greedy(r: WorkloadRequest) -> SamplingParams:
    return SamplingParams(top_k=1, num_tokens_to_generate=r.output_len, ignore_eos=True)


def matmul_rates(device: torch.device) -> dict[str, float]:
    """FLOP/s of an 8192^3 matmul: bf16 cuBLAS, and the best FP8 path (``fp8_matmul_rate``); fixed
    stand-ins on CPU (plumbing only)."""
    from benchmarks.cuda_timing import median_ms

    if device.type != "cuda":
        return {"bf16": 1e12, "fp8": 2e12}
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return {"bf16": 2 * n**3 / (median_ms(lambda: a @ w.t(), 10) / 1e3), "fp8": fp8_matmul_rate(device)}


def fp8_matmul_rate(device: torch.device) -> float | None:
    """FLOP/s of an 8192^3 matmul on the best FP8 path (Triton W8A8, or ``torch._scaled_mm`` where
    its block-scaled recipe runs), activation quantization included; None off CUDA (no FP8 units)."""
    from benchmarks.cuda_timing import median_ms
    from benchmarks.fp8_kernel_times import scaled_mm_runs
    from megatron_async.kernels import fp8_quant as fq, triton_fp8_gemm as tg

    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    q, s = fq.quantize_weight(torch.randn(n, n, device=device, dtype=torch.bfloat16))
    fp8 = [median_ms(lambda: tg.fp8_linear(a, q, s), 10)]
    if scaled_mm_runs(device) is None:
        fp8.append(median_ms(lambda: tg.scaled_mm_linear(a, q, s), 10))
    return 2 * n**3 / (min(fp8) / 1e3)


def run_config(name: str, args, workloads: dict, bandwidth: float, rates: dict) -> dict:
    quantization, kv_dtype = CONFIGS[name]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = InferenceConfig(max_requests=128 if cuda else 8, max_tokens=8192 if cuda else 256,
                          max_sequence_length=args.max_sequence_length, kv_cache_dtype=kv_dtype,
                          buffer_size_gb=None if cuda else 0.05, cuda_graphs=cuda)
    t0 = time.perf_counter()
    llm = LLM(None, args.device, "bfloat16" if cuda else "float32", cfg, default_model=args.model,
              quantization=quantization)
    row = {"config": name, "build_s": time.perf_counter() - t0,
           "kv_tokens": llm.context.num_kv_blocks * llm.context.block_size}
    for wname, requests in workloads.items():
        run_workload(llm.engine, [WorkloadRequest(r.prompt, 4) for r in requests[:2]], greedy)  # compile, warm
        window = StatsWindow(llm.engine)
        run = run_workload(llm.engine, requests, greedy)
        st = window.stats()
        s = summarize(run, st, device)
        prompts, outputs = [len(r.prompt) for r in requests], [r.output_len for r in requests]
        kv_dt = torch.float8_e4m3fn if kv_dtype != "auto" else llm.dtype
        floor = decode_floor(llm.model, kv_dt, s.mean_decode_batch, mean_context_per_output_token(prompts, outputs),
                             bandwidth)
        fp8 = prefill_flops(llm.model, prompts, sum(prompts), fp8_only=True)  # 0 without FP8 weights
        mixed = mixed_floor(llm.model, kv_dt, prefill_flops(llm.model, prompts, sum(prompts)), max(1, st.prefill_steps),
                            st.mixed_kv_read_tokens, st.mixed_step_tokens, rates["bf16"], bandwidth, fp8, rates["fp8"])
        mixed_floor_ms = 1e3 * mixed.seconds
        row[wname] = {"tok_s": s.output_tokens_per_s, "decode_ms": s.mean_decode_step_ms,
                      "decode_batch": s.mean_decode_batch,
                      "tpot_ms": s.tpot_p50_ms, "prefill_ms": s.mean_prefill_step_ms,
                      "decode_floor_x": s.mean_decode_step_ms / (floor.seconds * 1e3),
                      "mixed_floor_x": s.mean_prefill_step_ms / mixed_floor_ms, "failed": s.failed_requests}
    llm.close()
    return row


def workloads(args) -> dict[str, list[WorkloadRequest]]:
    vocab = DEFAULT_CONFIGS[args.model]["vocab_size"]
    if args.smoke:
        out = {"batch1": synthetic_workload(WorkloadSpec(1, 16, 16, 8, 8, 0.0, 0), vocab),
               "A": synthetic_workload(WorkloadSpec(6, 8, 40, 6, 6, 0.0, 0), vocab)}
        if args.long:
            out["long"] = synthetic_workload(WorkloadSpec(2, 60, 80, 4, 4, 0.0, 0), vocab)
        return out
    out = {"batch1": synthetic_workload(WorkloadSpec(1, 512, 512, 256, 256, 0.0, 0), vocab),
           "A": synthetic_workload(WorkloadSpec(128, 100, 1024, 128, 128, 0.0, 0), vocab)}
    if args.long:
        out["long"] = synthetic_workload(WorkloadSpec(32, 8000, 16000, 64, 64, 0.0, 0), vocab)
    return out


def run(args) -> list[dict]:
    device = torch.device(args.device)
    bandwidth = measure_copy_bandwidth(device)
    rates = matmul_rates(device)
    loads = workloads(args)
    rows = [in_own_process(args.device, run_config, name, args, loads, bandwidth, rates) for name in args.configs]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n{name}, built-in {args.model}; copy {bandwidth / 1e9:,.0f} GB/s; matmul 8192^3 bf16 "
          f"{rates['bf16'] / 1e12:,.0f} / fp8 {rates['fp8'] / 1e12:,.0f} TFLOP/s")
    print(f"{'config':<7} {'KV tokens':>10} {'b1 ms/tok':>9} {'A tok/s':>8} {'x bf16':>6} {'decode ms':>9} "
          f"{'/floor':>6} {'mixed ms':>8} {'/floor':>6}"
          + (f" {'long tok/s':>10} {'x bf16':>6} {'long decode ms':>14} {'rows':>5} {'x bf16':>6}" if args.long else ""))
    base = next((r for r in rows if r["config"] == "bf16"), rows[0])
    for r in rows:
        a, b1 = r["A"], r["batch1"]
        line = (f"{r['config']:<7} {r['kv_tokens']:>10,} {b1['tpot_ms'] or 0:>9.2f} {a['tok_s']:>8,.0f} "
                f"{a['tok_s'] / base['A']['tok_s']:>6.2f} {a['decode_ms']:>9.2f} {a['decode_floor_x']:>6.2f} "
                f"{a['prefill_ms']:>8.1f} {a['mixed_floor_x']:>6.2f}")
        if args.long:
            lg, lb = r["long"], base["long"]
            per_row = lb["decode_ms"] / lb["decode_batch"] / (lg["decode_ms"] / lg["decode_batch"])
            line += (f" {lg['tok_s']:>10,.0f} {lg['tok_s'] / lb['tok_s']:>6.2f} {lg['decode_ms']:>14.2f}"
                     f" {lg['decode_batch']:>5.1f} {per_row:>6.2f}")
        print(line)
    return rows
