"""Command-line flags shared by the main job, the benchmark and the profiler, and the
objects built from them (InferenceConfig, WorkloadSpec, SamplingParams)."""
from __future__ import annotations

import argparse

import torch

from megatron_async.config import AttentionBackend, InferenceConfig
from megatron_async.inference.request import SamplingParams
from megatron_async.models.default_model import DEFAULT_CONFIGS
from megatron_async.tools.workload import WorkloadRequest, WorkloadSpec

# Workload defaults by device: seconds on a laptop CPU with the tiny model; the benchmark
# shape on a GPU.
WORKLOAD_DEFAULTS = {
    "cpu": {"num_requests": 32, "prompt_len_min": 16, "prompt_len_max": 64, "output_len_min": 16, "output_len_max": 32},
    "cuda": {"num_requests": 256, "prompt_len_min": 100, "prompt_len_max": 1024, "output_len_min": 100,
             "output_len_max": 1024},
}
# InferenceConfig defaults that differ on a GPU (None = the dataclass default).
# On CUDA, large prefill chunks amortise the eager (launch-bound) mixed steps; vLLM also
# defaults to 8192 batched tokens.
ENGINE_DEFAULTS = {"cpu": {"max_requests": None}, "cuda": {"max_requests": 128, "max_tokens": 8192}}
GPU_KV_FRACTION = 0.5
"""Default KV pool on CUDA: this share of the device memory free when the engine is built."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_model_args(p: argparse.ArgumentParser, require_model: bool = False) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", required=require_model, default=None,
                   help="HF checkpoint dir (config.json + *.safetensors [+ tokenizer.json]); default: built-in model")
    g.add_argument("--default-model", default=None, choices=sorted(DEFAULT_CONFIGS),
                   help="built-in random-weight model when --model is not given (default: tiny on cpu, qwen3-0.6b on cuda)")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--attention-backend", default="auto", choices=[b.value for b in AttentionBackend])


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="TP ranks (GPT models); > 1 needs a torchrun launch of that many processes, "
                        "e.g. NPROC=2 bash examples/run_torchrun.sh")
    g.add_argument("--expert-parallel-size", type=int, default=1,
                   help="data-parallel engines (MoE experts split across them); > 1 needs a torchrun launch "
                        "of that many processes, e.g. NPROC=2 EP=1 bash examples/run_torchrun.sh")


def add_engine_args(p: argparse.ArgumentParser, mode_flags: bool = True) -> None:
    """``mode_flags=False`` leaves out --serial / --cuda-graphs (the benchmark sets them per mode)."""
    g = p.add_argument_group("engine (InferenceConfig)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides --buffer-size-gb)")
    g.add_argument("--buffer-size-gb", type=float, default=None,
                   help=f"KV pool budget (default: 1 on cpu, {GPU_KV_FRACTION * 100:.0f}%% of free memory on cuda)")
    g.add_argument("--max-requests", type=int, default=None, help="most active requests")
    g.add_argument("--max-tokens", type=int, default=None, help="most tokens per step")
    g.add_argument("--max-sequence-length", type=int, default=None)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--prefix-caching", action="store_true")
    if mode_flags:
        g.add_argument("--serial", action="store_true", help="turn launch-ahead (async scheduling) off")
        g.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs")
    g.add_argument("--logging-step-interval", type=int, default=0, help="log (and time) every N steps")
    g.add_argument("--nvtx", action="store_true", help="NVTX ranges around engine stages (for nsys)")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (defaults depend on the device)")
    g.add_argument("--num-requests", type=int, default=None)
    g.add_argument("--prompt-len-min", type=int, default=None)
    g.add_argument("--prompt-len-max", type=int, default=None)
    g.add_argument("--output-len-min", type=int, default=None)
    g.add_argument("--output-len-max", type=int, default=None)
    g.add_argument("--arrival-rate", type=float, default=0.0,
                   help="mean requests per engine step (Poisson, deterministic schedule); 0 = all at once")
    g.add_argument("--request-rate", type=float, default=0.0,
                   help="mean requests per second of wall clock (Poisson arrivals, serving-like); 0 = off")
    g.add_argument("--prompt-file", default=None, help="text prompts, one per line (needs a tokenizer)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off; 1 = greedy")
    g.add_argument("--top-p", type=float, default=0.0, help="0 = off")
    g.add_argument("--seed", type=int, default=0, help="seeds the workload and the engine's per-request seeds")
    g.add_argument("--return-log-probs", action="store_true")
    g.add_argument("--stop-at-eos", action="store_true", help="stop at EOS (default: ignore EOS, exact output lengths)")


def resolve_device_args(args: argparse.Namespace) -> None:
    """Fill device-dependent defaults in place: device, dtype, default model, workload sizes."""
    args.device = args.device or default_device()
    kind = torch.device(args.device).type
    if args.dtype is None:
        args.dtype = "bfloat16" if kind == "cuda" else "float32"
    if getattr(args, "default_model", None) is None:
        args.default_model = "qwen3-0.6b" if kind == "cuda" else "tiny"
    for name, value in WORKLOAD_DEFAULTS.get(kind, WORKLOAD_DEFAULTS["cpu"]).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for name, value in ENGINE_DEFAULTS.get(kind, ENGINE_DEFAULTS["cpu"]).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def default_buffer_gb(device: torch.device) -> float | None:
    """KV budget when none is given: a share of free device memory on CUDA, else the config default."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return GPU_KV_FRACTION * free / 1e9


def inference_config_from_args(args: argparse.Namespace, **overrides) -> InferenceConfig:
    """An InferenceConfig from the flags; flags left unset keep the dataclass defaults."""
    buffer_gb = args.buffer_size_gb if args.buffer_size_gb is not None else default_buffer_gb(torch.device(args.device))
    fields = {
        "block_size_tokens": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "buffer_size_gb": buffer_gb,
        "max_requests": args.max_requests,
        "max_tokens": args.max_tokens,
        "max_sequence_length": args.max_sequence_length,
        "enable_chunked_prefill": not args.no_chunked_prefill,
        "enable_prefix_caching": args.prefix_caching,
        "async_scheduling": not getattr(args, "serial", False),
        "cuda_graphs": getattr(args, "cuda_graphs", False),
        "logging_step_interval": args.logging_step_interval,
        "nvtx_ranges": args.nvtx,
        "attention_backend": args.attention_backend,
        "seed": args.seed,
    }
    cfg = InferenceConfig(**{k: v for k, v in fields.items() if v is not None})
    if cfg.max_tokens < cfg.max_requests and args.max_tokens is None:
        cfg.max_tokens = cfg.max_requests  # every active request must fit one decode token per step
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def workload_spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(args.num_requests, args.prompt_len_min, args.prompt_len_max, args.output_len_min,
                        args.output_len_max, args.arrival_rate, args.seed, request_rate=args.request_rate)


def sampling_factory(args: argparse.Namespace):
    """WorkloadRequest -> SamplingParams from the sampling flags."""

    def make(req: WorkloadRequest) -> SamplingParams:
        return SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            num_tokens_to_generate=req.output_len, ignore_eos=not args.stop_at_eos,
            return_log_probs=args.return_log_probs,
        )

    return make
