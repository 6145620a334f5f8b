"""Side-by-side benchmark: one workload, one set of weights, several modes in one process.

Modes: HF ``generate`` (static batches; dynamic cache, or static cache + torch.compile), HF
continuous batching (``generate_batch``), this engine serial, async (launch-ahead), and both
with CUDA graphs; each on a greedy and a sampled workload. Every side warms up on the same
twin workload (same lengths, fresh tokens) before its timed run. See docs/PERFORMANCE.md."""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import hf_peers
from benchmarks.active_experts import decode_expert_share
from benchmarks.bench_report import HF_PEERS, ModeResult, add_ratios, format_table, plot_step_times
from benchmarks.compile_counter import CompileCounter
from benchmarks.gpu_idle import profile_run
from benchmarks.roofline import (
    decode_floor, mean_context_per_output_token, measure_copy_bandwidth, measure_matmul_flops, mixed_floor, prefill_flops,
)
from benchmarks.side_by_side_args import ENGINE_MODES, MODES, WORKLOADS, parse_args
from megatron_async import LLM, SamplingParams
from megatron_async.cli import flags
from megatron_async.cli.driver import StatsWindow, WorkloadRun, run_workload
from megatron_async.cli.summary import summarize
from megatron_async.cli.workload import WorkloadRequest, WorkloadSpec, synthetic_workload, twin_workload
from megatron_async.model_loading import parse_dtype
from megatron_async.models.default_checkpoint import save_default_checkpoint
from megatron_async.models.default_model import DEFAULT_CONFIGS

HF_CACHE_MEMORY_FRACTION = 0.5
"""HF continuous batching: share of the free memory its auto-sized KV cache may take."""
def params_factory(workload: str, seed: int, requests: list[WorkloadRequest]):
    """WorkloadRequest -> SamplingParams; a sampled request's seed is fixed by its index."""
    s = WORKLOADS[workload]
    index = {id(r): i for i, r in enumerate(requests)}

    def make(req: WorkloadRequest) -> SamplingParams:
        if s.greedy:
            return SamplingParams(top_k=1, num_tokens_to_generate=req.output_len, ignore_eos=True)
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=seed * 100_003 + index[id(req)],
                              num_tokens_to_generate=req.output_len, ignore_eos=True)

    return make


def step_outliers(run: WorkloadRun) -> tuple[float | None, float | None, int]:
    """First step ms, max step ms, and steps over 5x the median of their kind."""
    if not run.steps:
        return None, None, 0
    slow = 0
    for decode in (True, False):
        ms = [s.seconds for s in run.steps if s.decode_only == decode]
        if ms:
            med = statistics.median(ms)
            slow += sum(x > 5 * med for x in ms)
    return 1e3 * run.steps[0].seconds, 1e3 * max(s.seconds for s in run.steps), slow


def _free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class Benchmark:
    """Holds what every mode shares: the workload and its warm-up twin, the checkpoint, the
    time budget, the copy bandwidth, and the serial engine's tokens per workload (the
    reference the others are compared with)."""

    def __init__(self, args: argparse.Namespace, checkpoint: str | None):
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = parse_dtype(args.dtype)
        self.checkpoint = checkpoint
        self.deadline = time.perf_counter() + 60 * args.max_minutes
        self.bandwidth = measure_copy_bandwidth(self.device)
        self.matmul_flops = measure_matmul_flops(self.device, self.dtype)
        self.fp8_flops = None  # FP8 weights on CUDA: the FP8 path's rate, at which their products' floor counts
        if args.quantization == "fp8":
            from benchmarks.fp8_engine_times import fp8_matmul_rate

            self.fp8_flops = fp8_matmul_rate(self.device)
        vocab = (json.loads((Path(checkpoint) / "config.json").read_text()) if checkpoint
                 else DEFAULT_CONFIGS[args.default_model])["vocab_size"]
        spec = WorkloadSpec(args.num_requests, args.prompt_len_min, args.prompt_len_max, args.output_len_min,
                            args.output_len_max, 0.0, args.seed, request_rate=args.request_rate)
        self.requests = synthetic_workload(spec, vocab)
        self.warmup = twin_workload(self.requests[: args.warmup_requests or len(self.requests)], vocab, args.seed)
        prompt_lens = [len(r.prompt) for r in self.requests]
        self.info = {
            "mean_context": mean_context_per_output_token(prompt_lens, [r.output_len for r in self.requests]),
            "mean_prompt_len": round(sum(prompt_lens) / len(prompt_lens)),
            "warmup_requests": len(self.warmup),
        }
        self.serial_tokens: dict[tuple[str, str], list[list[int] | None]] = {}
        self.expert_shares: dict[int, float | None] = {}

    def time_left(self) -> bool:
        return time.perf_counter() < self.deadline

    # ------------------------------------------------------------------ HF peers
    def run_hf(self, modes: list[str]) -> list[ModeResult]:
        _free_device()
        too_big = hf_peers.does_not_fit(self.checkpoint, self.device, self.dtype)
        if too_big:
            return [ModeResult(m, w, "skipped", too_big) for m in modes for w in self.args.workloads]
        try:
            model = hf_peers.load_hf_model(self.checkpoint, self.device, self.dtype)
        except torch.OutOfMemoryError:
            return [ModeResult(m, w, "skipped", "HF does not fit this device: CUDA out of memory loading the model")
                    for m in modes for w in self.args.workloads]
        except Exception as e:  # noqa: BLE001 - a broken peer must not hide our own numbers
            return [ModeResult(m, w, "error", f"loading the HF model failed: {e}") for m in modes for w in self.args.workloads]
        results = []
        for mode in modes:
            for wl in self.args.workloads:
                results.append(self._run_hf_mode(model, mode, wl))
        del model
        _free_device()
        return results

    def _run_hf_mode(self, model, mode: str, wl: str) -> ModeResult:
        a = self.args
        if not self.time_left():
            return ModeResult(mode, wl, "skipped", "time budget (--max-minutes) spent")
        if mode == "hf_generate_batch" and not hf_peers.continuous_batching_available(model):
            return ModeResult(mode, wl, "skipped", "this transformers has no continuous batching")
        if mode == "hf_generate_static" and self.device.type != "cuda":
            return ModeResult(mode, wl, "skipped", "static cache + torch.compile: CUDA only here")
        _free_device()
        sampling = WORKLOADS[wl]
        try:
            if mode == "hf_generate_batch":
                cb = hf_peers.cb_config(self.device, self.requests, a.max_requests, a.max_tokens, HF_CACHE_MEMORY_FRACTION)
                settings = "continuous batching (generate_batch), " + ", ".join(
                    f"{k} {getattr(cb, k)}" for k in ("max_batch_tokens", "max_requests_per_batch", "max_memory_percent",
                                                       "page_size", "num_blocks", "use_cuda_graph") if hasattr(cb, k))
                run = hf_peers.run_hf_continuous_batching(model, self.requests, self.warmup, sampling, cb, self.deadline)
            else:
                static = mode == "hf_generate_static"
                settings = (f"generate, batch {a.hf_batch_size}, sdpa, "
                            + ("static cache + torch.compile (HF auto-compile)" if static else "dynamic cache, eager"))
                t0 = time.perf_counter()
                hf_peers.run_hf_generate(model, self.warmup, a.hf_batch_size, sampling, None, static)  # warm-up twin
                settings += f", warm-up {time.perf_counter() - t0:.1f} s"
                gc.collect()
                run = hf_peers.run_hf_generate(model, self.requests, a.hf_batch_size, sampling, self.deadline, static)
        except torch.OutOfMemoryError:
            return ModeResult(mode, wl, "skipped", f"HF does not fit this device at these settings: CUDA out of memory "
                                                   f"({torch.cuda.max_memory_allocated() / 2**30:.1f} GiB peak)")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            return ModeResult(mode, wl, "error", f"{type(e).__name__}: {e}")
        res = ModeResult(mode, wl, "timed_out" if run.timed_out else "ok", settings=settings, output_tokens=run.output_tokens,
                         wall_time_s=run.wall_time, output_tokens_per_s=run.output_tokens / run.wall_time)
        if sampling.greedy:  # HF samples from one generator: its sampled tokens cannot match per-request draws
            res.same_tokens_as_serial = self._match_serial(wl, mode, run.outputs)
        res.summary = {"peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None}
        return res

    # ------------------------------------------------------------------ the engine
    def run_engine(self, mode: str) -> list[ModeResult]:
        wls = self.args.workloads
        if ENGINE_MODES[mode]["cuda_graphs"] and self.device.type != "cuda":
            return [ModeResult(mode, w, "skipped", "CUDA graphs need a GPU") for w in wls]
        if not self.time_left():
            return [ModeResult(mode, w, "skipped", "time budget (--max-minutes) spent") for w in wls]
        _free_device()
        cfg = flags.inference_config_from_args(self.args, **ENGINE_MODES[mode])
        llm = LLM(self.checkpoint, self.args.device, self.dtype, cfg, default_model=self.args.default_model,
                  quantization=self.args.quantization)
        st = llm.engine.stats  # the startup warm-up (CUDA) ran inside LLM(): every build and capture
        startup = {"seconds": st.warmup_seconds, "memory_gib": st.warmup_memory_bytes / 2**30,
                   "graphs": st.warmup_graphs, "triton_builds": st.warmup_triton_builds}
        t0 = time.perf_counter()
        if not self.args.no_twin_warmup:
            for wl in wls:  # the same twin warm-up as the HF peers
                run_workload(llm.engine, self.warmup, params_factory(wl, self.args.seed + 1, self.warmup))
        warm_s = time.perf_counter() - t0
        results = [self._timed_engine_run(llm, mode, wl, warm_s, startup) for wl in wls]
        del llm
        _free_device()
        return results

    def _timed_engine_run(self, llm: LLM, mode: str, wl: str, warm_s: float, startup: dict) -> ModeResult:
        """``--repeats`` timed runs; the median one's numbers (every run's tok/s kept), then the
        profiled run for the device idle shares."""
        if not self.time_left():
            return ModeResult(mode, wl, "skipped", "time budget (--max-minutes) spent")
        make = params_factory(wl, self.args.seed, self.requests)
        runs = []
        for _ in range(self.args.repeats):
            if runs and not self.time_left():
                break
            runs.append(self._one_timed_run(llm, mode, wl, make, warm_s, startup))
        res = sorted(runs, key=lambda r: r.output_tokens_per_s)[(len(runs) - 1) // 2]
        res.tokens_per_s_runs = [r.output_tokens_per_s for r in runs]
        if self.device.type == "cuda" and not self.args.no_idle_profile and self.time_left():
            prof_run, idle = profile_run(llm.engine, lambda: run_workload(llm.engine, self.requests, make,
                                                                          deadline=self.deadline))
            res.run_idle_share, res.decode_idle_share = idle.run_idle_share, idle.decode_idle_share
            res.profiled_tokens_per_s = prof_run.output_tokens / prof_run.wall_time if prof_run.wall_time else None
            res.idle_profile = asdict(idle)
        return res

    def _one_timed_run(self, llm: LLM, mode: str, wl: str, make, warm_s: float, startup: dict) -> ModeResult:
        gc.collect()  # earlier runs' garbage (a profiled run's) is collected here, not as a stall in this run
        window = StatsWindow(llm.engine)
        with CompileCounter(llm.runner.graphs) as compiles:
            run = run_workload(llm.engine, self.requests, make, deadline=self.deadline)
        st = window.stats()
        summary = summarize(run, st, self.device)
        share = self._expert_share(llm, run.mean_decode_batch)  # after the window: it runs requests
        floor = decode_floor(llm.model, self.dtype, run.mean_decode_batch, self.info["mean_context"], self.bandwidth,
                             1.0 if share is None else share)
        first, worst, slow = step_outliers(run)
        res = ModeResult(
            mode, wl, "timed_out" if run.timed_out else "ok",
            settings=(f"{ENGINE_MODES[mode]}, startup warm-up {startup['seconds']:.1f} s ({startup['graphs']} graphs, "
                      f"{startup['triton_builds']} Triton builds, {startup['memory_gib']:.2f} GiB), twin warm-up {warm_s:.1f} s"),
            startup_warmup=startup, mean_mixed_step_ms=summary.mean_prefill_step_ms or None,
            output_tokens=run.output_tokens, wall_time_s=run.wall_time, output_tokens_per_s=summary.output_tokens_per_s,
            mean_decode_step_ms=summary.mean_decode_step_ms, mean_decode_batch=run.mean_decode_batch,
            decode_floor_ms=1e3 * floor.seconds, decode_expert_share=share, latency_ms=run.latency_ms(), summary=summary.as_dict(),
            first_step_ms=first, max_step_ms=worst, slow_steps=slow,
            triton_builds=compiles.triton_builds if compiles._knobs is not None else None,
            graph_captures=compiles.graph_captures, built_kernels=compiles.kernels,
            step_times=[(s.t, 1e3 * s.seconds, s.decode_only) for s in run.steps],
        )
        if res.mean_decode_step_ms:
            res.step_over_floor = res.mean_decode_step_ms / res.decode_floor_ms
        prompts = [len(r.prompt) for r in self.requests]
        flops = prefill_flops(llm.model, prompts, st.prefill_tokens)
        if st.prefill_steps and res.mean_mixed_step_ms:
            fp8 = prefill_flops(llm.model, prompts, st.prefill_tokens, fp8_only=True) if self.fp8_flops else 0.0
            mixed = mixed_floor(llm.model, self.dtype, flops, st.prefill_steps, st.mixed_kv_read_tokens,
                                st.mixed_step_tokens, self.matmul_flops, self.bandwidth, fp8, self.fp8_flops or 0.0)
            res.mixed_floor_ms, res.mixed_flop_floor_ms = 1e3 * mixed.seconds, 1e3 * mixed.flop_seconds
            res.mixed_over_floor = res.mean_mixed_step_ms / res.mixed_floor_ms
        tokens = [o.generated_tokens if o is not None else None for o in run.outputs]
        if mode in ("serial", "serial_graphs"):
            self.serial_tokens[(wl, mode)] = tokens
        res.same_tokens_as_serial = self._match_serial(wl, mode, tokens)
        return res

    def _expert_share(self, llm: LLM, batch: float | None) -> float | None:
        """MoE: the share of routed experts a decode step of this many rows of the workload reads
        (measured once per batch size); None for dense models or without decode steps."""
        if not batch:
            return None
        rows = max(1, round(batch))
        if rows not in self.expert_shares:
            self.expert_shares[rows] = decode_expert_share(llm, [r.prompt for r in self.requests], rows)
        return self.expert_shares[rows]

    def _match_serial(self, wl: str, mode: str, tokens: list[list[int] | None]) -> float | None:
        """Share of requests whose tokens equal the serial engine's: with graphs (``*_graphs``,
        where padding shapes differ from eager) the serial graphs mode's, else the eager one's."""
        ref = self.serial_tokens.get((wl, "serial_graphs" if mode.endswith("_graphs") else "serial"))
        if ref is None:
            return None
        pairs = [(a, b) for a, b in zip(tokens, ref) if a is not None and b is not None]
        return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def _prepare_checkpoint(args: argparse.Namespace, tmp: str, hf_modes: list[str]) -> tuple[str | None, list[str]]:
    """The checkpoint both sides load, and notes. Without HF modes or without transformers (and
    no --model) the engine runs its own built-in model (the same weights a written checkpoint
    holds), and the HF modes are skipped."""
    if args.model:
        return args.model, []
    if not hf_modes:
        return None, []
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None, ["transformers is not installed: HF modes skipped, engine uses its built-in weights"]
    path = save_default_checkpoint(args.default_model, Path(tmp) / args.default_model, torch.device(args.device),
                                            parse_dtype(args.dtype), seed=args.seed)
    return str(path), []


def main(argv: list[str] | None = None) -> list[ModeResult]:
    args = parse_args(argv)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_modes = [m for m in args.modes if m in HF_PEERS]
    with tempfile.TemporaryDirectory(prefix="megatron_async_bench_") as tmp:
        checkpoint, notes = _prepare_checkpoint(args, tmp, hf_modes)
        bench = Benchmark(args, checkpoint)
        print(f"benchmark: {checkpoint or 'built-in ' + args.default_model} on {args.device} ({args.dtype}); "
              f"{len(bench.requests)} requests, prompts {args.prompt_len_min}-{args.prompt_len_max}, outputs "
              f"{args.output_len_min}-{args.output_len_max}; copy bandwidth {bench.bandwidth / 1e9:,.1f} GB/s, "
              f"matmul {bench.matmul_flops / 1e12:,.1f} TFLOP/s",
              file=sys.stderr)
        results: list[ModeResult] = []
        # serial first among engine modes: the others are compared with its tokens
        for mode in [m for m in ENGINE_MODES if m in args.modes]:
            print(f"  running {mode} ...", file=sys.stderr)
            try:
                results.extend(bench.run_engine(mode))
            except Exception as e:  # noqa: BLE001 - report the failure, run the other modes
                traceback.print_exc()
                results.append(ModeResult(mode, ",".join(args.workloads), "error", f"{type(e).__name__}: {e}"))
        if hf_modes:
            if checkpoint is None:
                results = [ModeResult(m, w, "skipped", notes[0]) for m in hf_modes for w in args.workloads] + results
            else:
                print(f"  running {', '.join(hf_modes)} ...", file=sys.stderr)
                results = bench.run_hf(hf_modes) + results
    add_ratios(results)
    order = {m: i for i, m in enumerate(MODES)}
    results.sort(key=lambda r: (r.workload != "greedy", order[r.mode]))
    print(format_table(results))
    for note in notes:
        print(f"note: {note}")
    report = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": _version("transformers")},
        "model": args.model or f"built-in {args.default_model} (its seeded random weights, seed {args.seed})",
        "dtype": args.dtype, "args": vars(args), "copy_bandwidth_GBps": bench.bandwidth / 1e9,
        "matmul_TFLOPs": bench.matmul_flops / 1e12, **bench.info,
        "modes": [r.as_dict() for r in results],
    }
    (out_dir / "benchmark.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out_dir / 'benchmark.json'}; {plot_step_times(results, out_dir / 'step_times.png')}")
    return results


def _version(pkg: str) -> str | None:
    try:
        return __import__(pkg).__version__
    except ImportError:
        return None
