"""Command-line flags shared by the main job, the benchmark and the profiler, and the
objects built from them (InferenceConfig, WorkloadSpec, SamplingParams)."""
from __future__ import annotations

import argparse
import math
import os
from typing import Callable

from megatron_async.cli.workload import WorkloadRequest, WorkloadSpec
from megatron_async.config import AllReduceBackend, AttentionBackend, DpRouting, InferenceConfig
from megatron_async.inference.request import SamplingParams
from megatron_async.models.default_configs import DEFAULT_CONFIGS

# Workload defaults by device: seconds on a laptop CPU with the tiny model; the benchmark
# shape on a GPU.
WORKLOAD_DEFAULTS = {
    "cpu": {"num_requests": 32, "prompt_len_min": 16, "prompt_len_max": 64, "output_len_min": 16, "output_len_max": 32},
    "cuda": {"num_requests": 256, "prompt_len_min": 100, "prompt_len_max": 1024, "output_len_min": 100,
             "output_len_max": 1024},
}
# InferenceConfig defaults that differ on a GPU (None = the dataclass default).
# On CUDA, large prefill chunks amortise the eager (launch-bound) mixed steps; vLLM also
# defaults to 8192 batched tokens. On a CPU a step's time grows with its tokens, and every
# running stream waits for the step: 256-token chunks keep a stream's longest gap under ~1.5 s
# on a 2-core machine while a long prompt prefills (docs/PERFORMANCE.md, "CPU"), at little cost
# to that prompt's TTFT. Never below max_requests (every decode row fits one step).
ENGINE_DEFAULTS = {"cpu": {"max_requests": None, "max_tokens": 256}, "cuda": {"max_requests": 128, "max_tokens": 8192}}


class HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default once: appended only when the help text does not state it already
    and the default means something (not None / False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def checked(kind: type, lo: float | None = None, hi: float | None = None, name: str = "") -> Callable[[str], float]:
    """An argparse ``type``: parses ``kind`` (int or a finite float) within [lo, hi], so that bad
    values are argparse errors naming the flag, before any model is built."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    parse.__name__ = name or kind.__name__  # argparse names the type in some messages
    return parse


POSITIVE_INT = checked(int, 1, name="positive int")
NON_NEGATIVE_INT = checked(int, 0, name="non-negative int")


def default_device() -> str:
    import torch  # here, not at import: a front-end (``serve --engine``) parses these flags without torch

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
    g.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: the linears' weights in FP8 (e4m3, 128 x 128 block scales), quantized at load; a "
                        "checkpoint with an FP8 quantization_config loads in FP8 without it (LLM(quantization=...))")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", type=POSITIVE_INT, default=1,
                   help="TP ranks (GPT models); > 1 needs a torchrun launch of that many processes, "
                        "e.g. NPROC=2 bash examples/run_torchrun.sh")
    g.add_argument("--expert-parallel-size", type=int, default=1,
                   help="data-parallel engines (MoE experts split across them); > 1 needs a torchrun launch "
                        "of that many processes, e.g. NPROC=2 EP=1 bash examples/run_torchrun.sh")
    g.add_argument("--dp-routing", choices=[r.value for r in DpRouting], default=None,
                   help="data-parallel engines (behind a coordinator, or the ranks of --expert-parallel-size): "
                        "which engine a new request goes to (by free slots, or by what each engine's prefix cache "
                        "holds; InferenceConfig.dp_routing, default load_balanced)")
    g.add_argument("--dp-routing-alpha", type=checked(float, 0.0, 1.0), default=None,
                   help="--dp-routing scored: weight of prefix affinity against free capacity (default 0.5)")
    g.add_argument("--engine-timeout-s", type=checked(float, 1.0), default=None, dest="dp_engine_timeout_s",
                   help="--listen: the coordinator started here declares an engine that sent nothing for this long "
                        "dead; engines heartbeat every second (InferenceConfig.dp_engine_timeout_s, default 30)")


def _add_lora_args(g) -> None:
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters beside the base model (InferenceConfig.enable_lora; docs/LORA.md)")
    g.add_argument("--max-loras", type=POSITIVE_INT, default=None,
                   help="--enable-lora: most adapters loaded at once (InferenceConfig.max_loras, default 8)")
    g.add_argument("--max-lora-rank", type=POSITIVE_INT, default=None,
                   help="--enable-lora: largest adapter rank taken (InferenceConfig.max_lora_rank, default 16)")
    g.add_argument("--lora-grouped-rows", action=argparse.BooleanOptionalAction, default=None,
                   help="--enable-lora: each step groups its tokens by adapter for the LoRA ops "
                        "(InferenceConfig.lora_grouped_rows, default on; docs/LORA.md)")
    g.add_argument("--lora-experts", action="store_true", default=None,
                   help="--enable-lora: adapter slots on the MoE layers' routed experts too "
                        "(InferenceConfig.lora_experts; memory per expert, docs/LORA.md)")


def _add_kernel_switches(g) -> None:
    """The A/B switches of single kernels (InferenceConfig's kernel fields)."""
    g.add_argument("--no-split-linear", action="store_true",
                   help="TP=1 CUDA: every output projection on cuBLAS, none leaves its K-split sum to the next norm "
                        "(InferenceConfig.split_linear=False; default: split where the kernel's tiles take the shape)")
    g.add_argument("--long-prefill-tiles", action=argparse.BooleanOptionalAction, default=None,
                   help="a step whose longest prompt chunk has 2,048+ tokens runs the prefill attention's 128 x 64 "
                        "tiles, a CUDA-graph variant of its own (InferenceConfig.long_prefill_tiles; default on)")
    g.add_argument("--no-flashinfer-prefill", action="store_true",
                   help="long-tile steps keep every row on the Triton prefill attention, none on FlashInfer's FA3 kernel "
                        "(InferenceConfig.flashinfer_prefill=False; default: FA3 for rows of 128+ tokens where importable)")
    g.add_argument("--no-moe-grouped-mm", action="store_true",
                   help="Triton MoE: every batch on the fused Triton MoE, none as grouped GEMMs (InferenceConfig."
                        "moe_grouped_mm=False; default: prefill-size batches on Hopper / Blackwell as grouped GEMMs)")
    g.add_argument("--no-moe-triton-grouped-gemm", action="store_true",
                   help="grouped MoE experts: GEMMs on torch's CUTLASS grouped GEMM (FP8: the fused FP8 MoE) at every "
                        "size (InferenceConfig.moe_triton_grouped_gemm=False; default: Triton from 256 pairs an expert)")


def add_engine_args(p: argparse.ArgumentParser, mode_flags: bool = True) -> None:
    """``mode_flags=False`` leaves out --serial / --cuda-graphs (the benchmark sets them per mode)."""
    g = p.add_argument_group("engine (InferenceConfig)")
    g.add_argument("--block-size", type=POSITIVE_INT, default=None, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=POSITIVE_INT, default=None, help="KV pool size in blocks (overrides --buffer-size-gb)")
    g.add_argument("--buffer-size-gb", type=checked(float, 0.0), default=None,
                   help="KV pool budget in GB (default: 1 on cpu; on cuda what --gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=checked(float, 0.01, 1.0), default=None,
                   help="cuda, no KV size given: share of the device memory the engine may use; the KV pool gets "
                        "what the weights, the profiled peak step and the CUDA graph pools leave (default 0.9)")
    g.add_argument("--max-requests", type=POSITIVE_INT, default=None, help="most active requests")
    g.add_argument("--max-tokens", type=POSITIVE_INT, default=None, help="most tokens per step")
    g.add_argument("--priority-aging", type=POSITIVE_INT, default=None,
                   help="a waiting request (the server: a waiting body) moves up one priority class per this many "
                        "admissions (InferenceConfig.priority_aging, default 16)")
    g.add_argument("--max-sequence-length", type=POSITIVE_INT, default=None)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--prefix-caching", action="store_true")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default=None,
                   help="KV pool element type: auto = the model's dtype; fp8 = e4m3, twice the KV tokens "
                        "(InferenceConfig.kv_cache_dtype; default auto)")
    g.add_argument("--batch-invariant", action="store_true", help="batch-invariant numerics (InferenceConfig.batch_invariant)")
    g.add_argument("--tp-all-reduce", choices=[b.value for b in AllReduceBackend], default=None,
                   help="small TP all-reduces: P2P symmetric memory (auto: when the GPUs allow) or NCCL "
                        "(InferenceConfig.tp_all_reduce; default auto)")
    g.add_argument("--no-tp-fused-norm", action="store_true",
                   help="P2P path: keep the TP all-reduce and the next add + RMSNorm as two kernels "
                        "(InferenceConfig.tp_fused_norm=False)")
    _add_kernel_switches(g)
    g.add_argument("--num-speculative-tokens", type=checked(int, 0, name="int"), default=None,
                   help="speculative decoding: drafts verified per decode row (default 0: off)")
    g.add_argument("--speculative-method", choices=["mtp", "ngram"], default=None,
                   help="speculative decoding's drafter (default mtp)")
    if mode_flags:
        ahead = g.add_mutually_exclusive_group()
        ahead.add_argument("--serial", dest="launch_ahead", action="store_false", default=None,
                           help="turn launch-ahead (async scheduling) off")
        ahead.add_argument("--launch-ahead", dest="launch_ahead", action="store_true", default=None,
                           help="launch each step before the previous one is bookkept (the default, but for the "
                                "HTTP server's engine on a CPU)")
        graphs = g.add_mutually_exclusive_group()
        graphs.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=None,
                            help="replay decode and mixed steps as CUDA graphs (the default on cuda)")
        graphs.add_argument("--eager", dest="cuda_graphs", action="store_false", default=None,
                            help="no CUDA graphs: every step runs eager, nothing is captured at startup")
    g.add_argument("--no-warmup", action="store_true",
                   help="CUDA: skip the startup warm-up (Triton builds and graph captures then happen while serving)")
    g.add_argument("--startup-build-threads", type=NON_NEGATIVE_INT, default=None,
                   help="threads that build the warm-up's Triton kernels at once (default: this rank's share of the cores, at most 16; "
                        "0: one by one; InferenceConfig.startup_build_threads)")
    g.add_argument("--no-compile-workers", action="store_true",
                   help="CUDA: the build threads compile the warm-up's Triton kernels themselves, no worker processes "
                        "(InferenceConfig.startup_compile_workers=False; default: as many workers as build threads)")
    g.add_argument("--kernel-cache-dir", default=None,
                   help="Triton's on-disk kernel cache (sets TRITON_CACHE_DIR; default ~/.triton/cache): a later "
                        "process loads the kernels built there instead of compiling them, and finds the warm-up's kernels "
                        "from the list kept there (no dry captures)")
    g.add_argument("--kernel-lists", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the warm-up's kernel lists in Triton's cache directory and build a kept list at once "
                        "(InferenceConfig.startup_kernel_lists; default: on with --kernel-cache-dir, else off)")
    g.add_argument("--enable-suspend", action="store_true",
                   help="allocate weights, KV cache and graph pools so engine.suspend can free device memory "
                        "(InferenceConfig.enable_suspend; CUDA needs torch-memory-saver)")
    _add_lora_args(g)
    g.add_argument("--logging-step-interval", type=NON_NEGATIVE_INT, default=0, help="log (and time) every N steps")
    g.add_argument("--nvtx", action="store_true", help="NVTX ranges around engine stages (for nsys)")
    g.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=None,
                   help="freeze start-up's objects out of Python's garbage collections (InferenceConfig.gc_freeze; "
                        "default on when the job or server runs as a process of its own)")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (synthetic random-token prompts unless --prompts / --prompt-file; "
                             "sizes default by device)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompts", nargs="+", default=None, metavar="TEXT", help="one or more text prompts")
    src.add_argument("--prompt-file", default=None, help="text prompts, one per line (needs a tokenizer)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each text prompt as a user message in the checkpoint's chat template")
    g.add_argument("--num-requests", type=POSITIVE_INT, default=None,
                   help="synthetic requests; with text prompts, the most prompts used (default: all)")
    g.add_argument("--prompt-len-min", type=POSITIVE_INT, default=None)
    g.add_argument("--prompt-len-max", type=POSITIVE_INT, default=None)
    g.add_argument("--output-len-min", type=POSITIVE_INT, default=None)
    g.add_argument("--output-len-max", type=POSITIVE_INT, default=None)
    g.add_argument("--arrival-rate", type=checked(float, 0.0), default=0.0,
                   help="mean requests per engine step (Poisson, deterministic schedule); 0 = all at once")
    g.add_argument("--request-rate", type=checked(float, 0.0), default=0.0,
                   help="mean requests per second of wall clock (Poisson arrivals, serving-like); 0 = off")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--num-tokens-to-generate", type=POSITIVE_INT, default=None,
                   help="tokens per request (most, when EOS / stop words end it earlier); "
                        "default: drawn from --output-len-min..max; text prompts without those run to EOS, "
                        "at most 1,024 tokens or what max_sequence_length leaves")
    g.add_argument("--temperature", type=checked(float, 0.0), default=1.0, help="0 = greedy")
    g.add_argument("--top-k", type=NON_NEGATIVE_INT, default=0, help="0 = off; 1 = greedy")
    g.add_argument("--top-p", type=checked(float, 0.0, 1.0), default=0.0, help="0 = off")
    g.add_argument("--seed", type=checked(int, 0, 2**63 - 1), default=0,
                   help="seeds the workload and the engine's per-request seeds")
    g.add_argument("--min-p", type=checked(float, 0.0, 1.0), default=0.0,
                   help="keep tokens with probability >= min_p x the top token's; 0 = off")
    g.add_argument("--min-tokens", type=NON_NEGATIVE_INT, default=0, help="no EOS / stop before this many tokens")
    g.add_argument("--presence-penalty", type=checked(float, -2.0, 2.0), default=0.0)
    g.add_argument("--frequency-penalty", type=checked(float, -2.0, 2.0), default=0.0)
    g.add_argument("--repetition-penalty", type=checked(float, 0.01), default=1.0, help="1 = off")
    g.add_argument("--return-log-probs", action="store_true")
    g.add_argument("--top-n-logprobs", type=NON_NEGATIVE_INT, default=0, help="log-probs of the N likeliest tokens per step")
    g.add_argument("--stop-words", nargs="+", default=None, metavar="TEXT", help="stop when the output contains one")
    g.add_argument("--termination-id", type=NON_NEGATIVE_INT, default=None,
                   help="token id that ends a request (default: the tokenizer's / model's EOS)")
    eos = g.add_mutually_exclusive_group()
    eos.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=None,
                     help="run every request to its length (default for synthetic workloads)")
    eos.add_argument("--stop-at-eos", dest="ignore_eos", action="store_false",
                     help="stop at EOS (default for text prompts)")


def resolve_device_args(args: argparse.Namespace) -> None:
    """Fill device-dependent defaults in place: device, dtype, default model, workload sizes;
    point Triton at ``--kernel-cache-dir`` (before anything is built)."""
    if getattr(args, "kernel_cache_dir", None):
        os.environ["TRITON_CACHE_DIR"] = os.path.abspath(os.path.expanduser(args.kernel_cache_dir))
    args.device = args.device or default_device()
    kind = args.device.split(":", 1)[0]
    if args.dtype is None:
        args.dtype = "bfloat16" if kind == "cuda" else "float32"
    if getattr(args, "default_model", None) is None:
        args.default_model = "qwen3-0.6b" if kind == "cuda" else "tiny"
    text = has_text_prompts(args)
    for name, value in WORKLOAD_DEFAULTS.get(kind, WORKLOAD_DEFAULTS["cpu"]).items():
        if text and name.startswith("output_len"):  # text prompts run to EOS (text_prompts.TEXT_MAX_TOKENS)
            continue
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for name, value in ENGINE_DEFAULTS.get(kind, ENGINE_DEFAULTS["cpu"]).items():
        if getattr(args, name, None) is None:
            if name == "max_tokens" and args.max_requests is not None:
                value = max(value, args.max_requests)
            setattr(args, name, value)


def inference_config_from_args(args: argparse.Namespace, **overrides) -> InferenceConfig:
    """An InferenceConfig from the flags; flags left unset keep the dataclass defaults."""
    fields = {
        "block_size_tokens": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "buffer_size_gb": args.buffer_size_gb,
        "gpu_memory_utilization": getattr(args, "gpu_memory_utilization", None),
        "max_requests": args.max_requests,
        "max_tokens": args.max_tokens,
        "priority_aging": getattr(args, "priority_aging", None),
        "max_sequence_length": args.max_sequence_length,
        "enable_chunked_prefill": not args.no_chunked_prefill,
        "enable_prefix_caching": args.prefix_caching,
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", None),
        "batch_invariant": args.batch_invariant,
        "tp_all_reduce": args.tp_all_reduce,
        "tp_fused_norm": not getattr(args, "no_tp_fused_norm", False),
        "split_linear": not getattr(args, "no_split_linear", False),
        "long_prefill_tiles": getattr(args, "long_prefill_tiles", None),
        "flashinfer_prefill": not getattr(args, "no_flashinfer_prefill", False),
        "moe_grouped_mm": not getattr(args, "no_moe_grouped_mm", False),
        "moe_triton_grouped_gemm": not getattr(args, "no_moe_triton_grouped_gemm", False),
        "num_speculative_tokens": getattr(args, "num_speculative_tokens", None),
        "speculative_method": getattr(args, "speculative_method", None),
        "async_scheduling": getattr(args, "launch_ahead", None),
        "cuda_graphs": getattr(args, "cuda_graphs", None),
        "startup_warmup": not args.no_warmup,
        "startup_build_threads": getattr(args, "startup_build_threads", None),
        "startup_compile_workers": not getattr(args, "no_compile_workers", False),
        "startup_kernel_lists": _kernel_lists(args),
        "enable_suspend": getattr(args, "enable_suspend", False),
        "enable_lora": getattr(args, "enable_lora", None),
        "max_loras": getattr(args, "max_loras", None),
        "max_lora_rank": getattr(args, "max_lora_rank", None),
        "lora_grouped_rows": getattr(args, "lora_grouped_rows", None),
        "kv_transfer_kernel": getattr(args, "kv_transfer_kernel", None),
        "kv_send_mid_step": getattr(args, "kv_send_mid_step", None),
        "lora_experts": getattr(args, "lora_experts", None),
        "logging_step_interval": args.logging_step_interval,
        "nvtx_ranges": args.nvtx,
        "gc_freeze": getattr(args, "gc_freeze", None),
        "attention_backend": args.attention_backend,
        "seed": args.seed,
        "dp_routing": getattr(args, "dp_routing", None),
        "dp_routing_alpha": getattr(args, "dp_routing_alpha", None),
        "dp_engine_timeout_s": getattr(args, "dp_engine_timeout_s", None),
    }
    cfg = InferenceConfig(**{k: v for k, v in fields.items() if v is not None})
    if cfg.max_tokens < cfg.max_requests and args.max_tokens is None:
        cfg.max_tokens = cfg.max_requests  # every active request must fit one decode token per step
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def own_process(args: argparse.Namespace) -> None:
    """The job or server runs as a process of its own (its script, not a caller's ``main()``):
    the defaults that take the whole process (``InferenceConfig.gc_freeze``) where no flag set them."""
    if getattr(args, "gc_freeze", None) is None:
        args.gc_freeze = True


def _kernel_lists(args: argparse.Namespace) -> bool:
    """``--kernel-lists``, else on for a ``--kernel-cache-dir`` (a directory the user keeps)."""
    asked = getattr(args, "kernel_lists", None)
    return asked if asked is not None else bool(getattr(args, "kernel_cache_dir", None))


def has_text_prompts(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "prompts", None) or getattr(args, "prompt_file", None))


def workload_spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    """``--num-tokens-to-generate`` pins every request's output length."""
    out_min, out_max = args.output_len_min, args.output_len_max
    if getattr(args, "num_tokens_to_generate", None) is not None:
        out_min = out_max = args.num_tokens_to_generate
    return WorkloadSpec(args.num_requests, args.prompt_len_min, args.prompt_len_max, out_min, out_max,
                        args.arrival_rate, args.seed, request_rate=args.request_rate)


def sampling_factory(args: argparse.Namespace) -> Callable[[WorkloadRequest], SamplingParams]:
    """WorkloadRequest -> SamplingParams from the sampling flags. EOS ends text prompts unless
    --ignore-eos; synthetic prompts ignore it unless --stop-at-eos (their lengths are the workload)."""
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else not has_text_prompts(args)

    def make(req: WorkloadRequest) -> SamplingParams:
        return SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            num_tokens_to_generate=req.output_len, ignore_eos=ignore_eos,
            return_log_probs=args.return_log_probs, top_n_logprobs=args.top_n_logprobs,
            termination_id=args.termination_id, stop_words=args.stop_words, min_p=args.min_p,
            min_tokens=args.min_tokens, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        )

    return make
