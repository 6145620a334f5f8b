"""The kernel fields of ``InferenceConfig``: which kernels the engine runs (attention, Mamba,
sampling, batch-invariant numerics, the fused paths a model may take or leave) and how start-up
builds them (warm-up, build threads, compile workers, kept kernel lists). ``InferenceConfig.kernels()``
hands them to the model, the model runner and the forward batches."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_async.config.modes import AttentionBackend, MambaBackend, SamplingBackend


@dataclass
class KernelFields:
    attention_backend: AttentionBackend = AttentionBackend.AUTO
    """Attention kernels to use (and the MoE experts' kernels: Triton fused MoE or the torch loop)."""

    mamba_backend: MambaBackend = MambaBackend.AUTO
    """SSM kernels to use for hybrid models."""

    sampling_backend: SamplingBackend = SamplingBackend.AUTO
    """Sampling (penalties, temperature, top-k / top-p / min-p, draws) implementation."""

    batch_invariant: bool = False
    """Batch-invariant numerics: a request's logits (so its tokens and log-probs) are bit
    for bit the same whatever else shares its steps, however its prompt was chunked, with or
    without CUDA-graph padding, prefix-cache hits or launch-ahead. Every matmul runs a
    fixed-tile Triton kernel, RMSNorm / log-softmax reduce each row alone, attention walks
    each row's keys in one fixed order (the same kernel for prefill and decode), and the TP
    sum adds ranks in a fixed order (same TP size only). Models of attention and MLP blocks
    (GPT; not Mamba2 layers); needs Triton (CUDA, or
    CPU with ``TRITON_INTERPRET=1``). Costs throughput; off = today's kernels, no extra work."""

    startup_warmup: bool = True
    """On CUDA, when the LLM is built: compile every Triton kernel variant the configuration can
    reach and capture every CUDA graph it can replay, so serving never compiles or captures
    (``EngineStats.triton_builds_after_warmup`` / ``graph_captures_after_warmup`` count any
    that still happen). Takes seconds; False = compile and capture lazily on first use."""

    startup_build_threads: int | None = None
    """Threads that build the warm-up's Triton kernels at once (CUDA). The warm-up first finds
    every kernel specialization its steps need without running them (each step captured into a
    CUDA graph that is thrown away, its unbuilt kernels skipped), then builds them all on this
    many threads, loading each from Triton's on-disk cache when a process built it before. None:
    this process's share of the usable cores (torchrun's ranks of one host split them), at most
    16; 0: build each kernel when a warm-up step first meets it."""

    startup_compile_workers: bool = True
    """On CUDA with ``startup_build_threads`` >= 2: fork that many worker processes before CUDA is
    initialized to compile the warm-up's Triton kernels side by side into Triton's on-disk cache,
    which the build threads then load (inference/triton_workers.py). False: the threads compile
    every kernel themselves (the GIL serializes most of each build)."""

    startup_kernel_lists: bool = False
    """Keep, beside Triton's on-disk cache, the list of kernels a start-up's dry pass found
    (text_generation_controllers/kernel_list.py), and build a kept list at once instead of
    capturing dry on a later start of the same configuration. Worth it only where the cache
    directory outlives the process (the main job's ``--kernel-cache-dir`` turns it on)."""

    split_linear: bool = True
    """CUDA, decode sizes: a projection runs as K-split partials that a kernel which runs anyway
    sums (kernels/triton_split_linear.py), where the tiles take the shape: a block's output
    projection's by the next RMSNorm (TP = 1) or the fused all-reduce + add + RMSNorm (a TP
    rank's, 1-16 rows), a TP rank's qkv projection's by the q/k norm + rope (1-16 rows). False:
    every such projection on cuBLAS (A/B)."""

    long_prefill_tiles: bool = True
    """Triton attention on Hopper, one engine (no expert parallelism): a step whose longest row has
    ``LONG_TILE_MIN_QUERY`` (2,048) query tokens or more runs the prefill attention on 128 x 64
    tiles, 8 warps, up to head_dim 128 (kernels/triton_prefill_common.py ``HOPPER_LONG``: an 8k
    prompt's attention 466-480 TFLOP/s against 404), other steps on the default 64 x 32 tiles,
    which suit short rows beside decode rows. In batch-invariant mode with a table of 8,192+
    keys, such a step runs its rows that fill a 128-row tile on such tiles, the others on 64-row
    tiles (the same bits: kernels/triton_invariant_attention.py ``launches``). The host picks it
    per step; mixed CUDA graphs of 2,048+ tokens get a long-tile twin (``GraphKey.long_tiles``).
    Counted by ``EngineStats.long_tile_steps``. On by default (one H200: 32 prompts of 8-16k on
    the 0.6B 696 against 661 out tok/s, a 16k-token Qwen3-8B prompt's first token 525 against 553
    ms); False: every step on the default tiles."""

    flashinfer_prefill: bool = True
    """With the long prefill tiles, where the ``flashinfer`` package is importable on an H100 / H200
    (bf16 / fp16 cache and queries, head_dim 64 / 128 / 256): a long-tile step's rows of 128+ query
    tokens run FlashInfer's FlashAttention-3 kernel (kernels/flashinfer_prefill.py), its one-token
    rows the split-K decode kernel, the others the Triton prefill kernel. FlashInfer builds the kernel on first use (minutes, then cached); a build or
    load that fails leaves every row on Triton, with a warning. False: Triton only (A/B)."""

    moe_grouped_mm: bool = True
    """Triton MoE on Hopper / Blackwell: prefill-size batches (more than 32 (token, expert) pairs an
    expert) run the experts as grouped GEMMs (kernels/moe_grouped_mm.py) instead of the fused
    Triton MoE, whose small blocks suit decode. False: every batch on the fused Triton MoE (A/B)."""

    moe_triton_grouped_gemm: bool = True
    """Batches of at least 256 (token, expert) pairs an expert on Hopper run the grouped experts'
    GEMMs in Triton (kernels/triton_grouped_gemm.py; FP8 experts: kernels/triton_fp8_grouped.py),
    the activation in the first GEMM's epilogue. False: torch's CUTLASS grouped GEMM (bf16), the
    fused FP8 MoE's kernels (FP8) (A/B)."""
