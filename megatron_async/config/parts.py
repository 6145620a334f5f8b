"""The frozen parts of ``InferenceConfig`` that components are given: each receives only what
it reads (``InferenceConfig.cache_sizing()``, ``scheduling()``, ``speculation()``,
``graph_sizing()``, ``kernels()``, ``communication()``, ``lora()``). Field meanings:
``InferenceConfig``'s docstrings. No defaults here: a part is only made by InferenceConfig's
methods, whose defaults hold."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_async.config.modes import (
    AllReduceBackend, AttentionBackend, DpRouting, MambaBackend, SamplingBackend, SpeculativeMethod,
)

@dataclass(frozen=True)
class CacheSizing:
    block_size_tokens: int
    num_kv_blocks: int | None
    kv_budget_gb: float
    max_requests: int
    max_tokens: int
    max_sequence_length: int
    max_samples: int
    enable_prefix_caching: bool
    prefix_caching_mamba_gb: float
    share_prompt_prefill: bool
    num_speculative_tokens: int
    kv_cache_dtype: str


@dataclass(frozen=True)
class Scheduling:
    max_requests: int
    max_tokens: int
    max_sequence_length: int
    enable_chunked_prefill: bool
    priority_aging: int
    async_scheduling: bool
    stream_text: bool
    logging_step_interval: int
    seed: int
    structured_outputs_backend: str
    grammar_threads: int
    dp_routing: DpRouting
    dp_routing_alpha: float
    weight_transfer_timeout_s: float


@dataclass(frozen=True)
class Speculation:
    num_speculative_tokens: int
    speculative_method: SpeculativeMethod
    speculative_ngram_max: int
    speculative_min_acceptance: float
    speculative_probe_interval: int
    speculative_max_batch_size: int
    max_sequence_length: int
    speculative_adaptive: bool | None = False
    cuda_graph_verify_widths: tuple[int, ...] | None = None


@dataclass(frozen=True)
class GraphSizing:
    max_requests: int
    max_tokens: int
    max_sequence_length: int
    num_speculative_tokens: int
    cuda_graph_batch_sizes: tuple[int, ...] | None
    cuda_graph_token_counts: tuple[int, ...] | None
    cuda_graph_verify_widths: tuple[int, ...] | None


@dataclass(frozen=True)
class KernelChoice:
    attention_backend: AttentionBackend
    mamba_backend: MambaBackend
    sampling_backend: SamplingBackend
    batch_invariant: bool
    startup_build_threads: int | None = None
    startup_kernel_lists: bool = False
    split_linear: bool = True
    long_prefill_tiles: bool = True
    flashinfer_prefill: bool = True
    moe_grouped_mm: bool = True
    moe_triton_grouped_gemm: bool = True


@dataclass(frozen=True)
class Communication:
    tp_all_reduce: AllReduceBackend
    tp_fused_norm: bool
    p2p_all_reduce_max_bytes: int
    ep_p2p_exchange: bool
    consensus_shared_memory: bool
    consensus_spin_us: float | None


@dataclass(frozen=True)
class LoRASizing:
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    lora_grouped_rows: bool
    lora_experts: bool
