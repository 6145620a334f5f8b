"""Side-by-side benchmark: one workload, one set of weights, several modes in one process.

Modes: HF ``generate`` (static batches), HF continuous batching (``generate_batch``), this
engine serial, async (launch-ahead) and async + CUDA graphs. See docs/PERFORMANCE.md."""
from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from megatron_async import LLM, SamplingParams
from megatron_async.llm import parse_dtype
from megatron_async.models.default_model import DEFAULT_CONFIGS
from megatron_async.tools import cli, hf_peers
from megatron_async.tools.bench_report import HF_PEERS, ModeResult, add_ratios, format_table, plot_step_times
from megatron_async.tools.driver import StatsWindow, run_workload
from megatron_async.tools.gpu_idle import profile_decode_steps
from megatron_async.tools.roofline import decode_floor, mean_context_per_output_token, measure_copy_bandwidth
from megatron_async.tools.summary import summarize
from megatron_async.tools.workload import WorkloadRequest, WorkloadSpec, synthetic_workload

ENGINE_MODES = {
    "serial": {"async_scheduling": False, "cuda_graphs": False},
    "async": {"async_scheduling": True, "cuda_graphs": False},
    "serial_graphs": {"async_scheduling": False, "cuda_graphs": True},
    "async_graphs": {"async_scheduling": True, "cuda_graphs": True},
}
MODES = (*HF_PEERS, *ENGINE_MODES)
SMOKE = {"device": "cpu", "default_model": "tiny", "num_requests": 8, "prompt_len_min": 8, "prompt_len_max": 32,
         "output_len_min": 8, "output_len_max": 16, "hf_batch_size": 4, "buffer_size_gb": 0.05, "max_minutes": 5.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cli.add_model_args(p)
    cli.add_engine_args(p, mode_flags=False)
    g = p.add_argument_group("benchmark")
    g.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    g.add_argument("--num-requests", type=int, default=256)
    g.add_argument("--prompt-len-min", type=int, default=100)
    g.add_argument("--prompt-len-max", type=int, default=1024)
    g.add_argument("--output-len-min", type=int, default=100)
    g.add_argument("--output-len-max", type=int, default=1024)
    g.add_argument("--hf-batch-size", type=int, default=32, help="batch size of HF generate (static batching)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--warmup-requests", type=int, default=4, help="short requests run before each engine mode")
    g.add_argument("--idle-steps", type=int, default=200, help="decode steps profiled for the GPU idle share (0 = skip)")
    g.add_argument("--max-minutes", type=float, default=30.0, help="stop starting/continuing modes after this")
    g.add_argument("--output-dir", default="benchmark_out", help="benchmark.json and step_times.png go here")
    g.add_argument("--smoke", action="store_true", help="tiny model, few requests, CPU: seconds")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)  # smoke values replace defaults, never flags given explicitly
    args = p.parse_args(argv)
    cli.resolve_device_args(args)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


def _greedy(req: WorkloadRequest) -> SamplingParams:
    return SamplingParams(top_k=1, num_tokens_to_generate=req.output_len, ignore_eos=True)


def _free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class Benchmark:
    """Holds what every mode shares: the workload, the checkpoint, the time budget, the
    copy bandwidth, and the serial engine's tokens (the reference the others are compared with)."""

    def __init__(self, args: argparse.Namespace, checkpoint: str | None):
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = parse_dtype(args.dtype)
        self.checkpoint = checkpoint
        self.deadline = time.perf_counter() + 60 * args.max_minutes
        self.bandwidth = measure_copy_bandwidth(self.device)
        vocab = (json.loads((Path(checkpoint) / "config.json").read_text()) if checkpoint
                 else DEFAULT_CONFIGS[args.default_model])["vocab_size"]
        spec = WorkloadSpec(args.num_requests, args.prompt_len_min, args.prompt_len_max, args.output_len_min,
                            args.output_len_max, 0.0, args.seed)
        self.requests = synthetic_workload(spec, vocab)
        prompt_lens = [len(r.prompt) for r in self.requests]
        self.info = {
            "mean_context": mean_context_per_output_token(prompt_lens, [r.output_len for r in self.requests]),
            "mean_prompt_len": round(sum(prompt_lens) / len(prompt_lens)),
        }
        self.serial_tokens: list[list[int] | None] | None = None

    def time_left(self) -> bool:
        return time.perf_counter() < self.deadline

    def run_hf(self, modes: list[str]) -> list[ModeResult]:
        results = []
        try:
            model = hf_peers.load_hf_model(self.checkpoint, self.device, self.dtype)
        except Exception as e:  # noqa: BLE001 - a broken peer must not hide our own numbers
            return [ModeResult(m, "error", f"loading the HF model failed: {e}") for m in modes]
        for mode in modes:
            if not self.time_left():
                results.append(ModeResult(mode, "skipped", "time budget (--max-minutes) spent"))
                continue
            if mode == "hf_generate_batch" and not hf_peers.continuous_batching_available(model):
                results.append(ModeResult(mode, "skipped", "this transformers has no continuous batching"))
                continue
            _free_device()
            try:
                if mode == "hf_generate":
                    run = hf_peers.run_hf_generate(model, self.requests, self.args.hf_batch_size, self.deadline)
                else:
                    run = hf_peers.run_hf_continuous_batching(model, self.requests, self.deadline)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                results.append(ModeResult(mode, "error", f"{type(e).__name__}: {e}"))
                continue
            res = ModeResult(mode, "timed_out" if run.timed_out else "ok", output_tokens=run.output_tokens,
                             wall_time_s=run.wall_time, output_tokens_per_s=run.output_tokens / run.wall_time)
            res.same_tokens_as_serial = self._match_serial(run.outputs)
            res.summary = {"peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None}
            results.append(res)
        del model
        _free_device()
        return results

    def run_engine(self, mode: str) -> ModeResult:
        if ENGINE_MODES[mode]["cuda_graphs"] and self.device.type != "cuda":
            return ModeResult(mode, "skipped", "CUDA graphs need a GPU")
        if not self.time_left():
            return ModeResult(mode, "skipped", "time budget (--max-minutes) spent")
        _free_device()
        cfg = cli.inference_config_from_args(self.args, **ENGINE_MODES[mode])
        llm = LLM(self.checkpoint, self.args.device, self.dtype, cfg, default_model=self.args.default_model)
        if llm.controller.graphs is not None:
            llm.controller.graphs.warmup()  # capture outside the measured window
        # full-length prompts: the Triton prefill kernels compile for the workload's shapes here,
        # not inside the timed run (seen on an H100: a hybrid serial run lost 3x to compiles)
        warm = [WorkloadRequest(r.prompt, 8) for r in self.requests[: self.args.warmup_requests]]
        run_workload(llm.engine, warm, _greedy)
        window = StatsWindow(llm.engine)
        run = run_workload(llm.engine, self.requests, _greedy, deadline=self.deadline)
        summary = summarize(run, window.stats(), self.device)
        floor = decode_floor(llm.model, self.dtype, run.mean_decode_batch, self.info["mean_context"], self.bandwidth)
        res = ModeResult(
            mode, "timed_out" if run.timed_out else "ok", output_tokens=run.output_tokens, wall_time_s=run.wall_time,
            output_tokens_per_s=summary.output_tokens_per_s, mean_decode_step_ms=summary.mean_decode_step_ms,
            mean_decode_batch=run.mean_decode_batch, decode_floor_ms=1e3 * floor.seconds, summary=summary.as_dict(),
            step_times=[(s.t, 1e3 * s.seconds, s.decode_only) for s in run.steps],
        )
        if res.mean_decode_step_ms:
            res.step_over_floor = res.mean_decode_step_ms / res.decode_floor_ms
        tokens = [o.generated_tokens if o is not None else None for o in run.outputs]
        if mode == "serial":
            self.serial_tokens = tokens
        res.same_tokens_as_serial = self._match_serial(tokens)
        if self.device.type == "cuda" and self.args.idle_steps > 0 and self.time_left() and run.mean_decode_batch:
            prof = profile_decode_steps(llm.engine, round(run.mean_decode_batch), self.info["mean_prompt_len"],
                                        self.args.idle_steps, seed=self.args.seed)
            res.gpu_idle_share = prof.idle_share
            res.gpu_wait_share = prof.event_idle_share
            res.idle_profile = asdict(prof)
        del llm, window
        _free_device()
        return res

    def _match_serial(self, tokens: list[list[int] | None]) -> float | None:
        if self.serial_tokens is None:
            return None
        pairs = [(a, b) for a, b in zip(tokens, self.serial_tokens) if a is not None and b is not None]
        return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def _prepare_checkpoint(args: argparse.Namespace, tmp: str) -> tuple[str | None, list[str]]:
    """The checkpoint both sides load, and notes. Without transformers (and no --model) the
    engine runs its own built-in model and the HF modes are skipped."""
    if args.model:
        return args.model, []
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None, ["transformers is not installed: HF modes skipped, engine uses its built-in weights"]
    path = hf_peers.save_default_checkpoint(args.default_model, Path(tmp) / args.default_model, torch.device(args.device),
                                            parse_dtype(args.dtype), seed=args.seed)
    return str(path), []


def main(argv: list[str] | None = None) -> list[ModeResult]:
    args = parse_args(argv)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_modes = [m for m in args.modes if m in HF_PEERS]
    with tempfile.TemporaryDirectory(prefix="megatron_async_bench_") as tmp:
        checkpoint, notes = _prepare_checkpoint(args, tmp)
        bench = Benchmark(args, checkpoint)
        print(f"benchmark: {checkpoint or 'built-in ' + args.default_model} on {args.device} ({args.dtype}); "
              f"{len(bench.requests)} requests, prompts {args.prompt_len_min}-{args.prompt_len_max}, outputs "
              f"{args.output_len_min}-{args.output_len_max}; copy bandwidth {bench.bandwidth / 1e9:,.1f} GB/s",
              file=sys.stderr)
        results: list[ModeResult] = []
        # serial first among engine modes: the others are compared with its tokens
        for mode in [m for m in ENGINE_MODES if m in args.modes]:
            print(f"  running {mode} ...", file=sys.stderr)
            try:
                results.append(bench.run_engine(mode))
            except Exception as e:  # noqa: BLE001 - report the failure, run the other modes
                traceback.print_exc()
                results.append(ModeResult(mode, "error", f"{type(e).__name__}: {e}"))
        if hf_modes:
            if checkpoint is None:
                results = [ModeResult(m, "skipped", notes[0]) for m in hf_modes] + results
            else:
                print(f"  running {', '.join(hf_modes)} ...", file=sys.stderr)
                results = bench.run_hf(hf_modes) + results
    add_ratios(results)
    order = {m: i for i, m in enumerate(MODES)}
    results.sort(key=lambda r: order[r.mode])
    print(format_table(results))
    for note in notes:
        print(f"note: {note}")
    report = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": _version("transformers")},
        "model": args.model or f"built-in {args.default_model} (HF random init, seed {args.seed})",
        "dtype": args.dtype, "args": vars(args), "copy_bandwidth_GBps": bench.bandwidth / 1e9, **bench.info,
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
