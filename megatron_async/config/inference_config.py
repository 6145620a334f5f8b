"""InferenceConfig: every knob of the engine, one documented field each. The KV cache, scheduling,
CUDA graph, data-parallel routing and serving fields are declared here; the kernel, communication,
speculative-decoding and LoRA groups in their own modules (kernel_fields.py,
communication_fields.py, speculative_fields.py, lora_fields.py), which ``InferenceConfig``
inherits: one flat dataclass. The rules across groups (``validate``), the device defaults
(``for_device``) and the parts components are given (``cache_sizing()`` ...) are here."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from megatron_async.config.communication_fields import CommunicationFields
from megatron_async.config.kernel_fields import KernelFields
from megatron_async.config.lora_fields import LoRAFields
from megatron_async.config.modes import (
    AllReduceBackend, AttentionBackend, DpRouting, MambaBackend, SamplingBackend, SpeculativeMethod,
)
from megatron_async.config.speculative_fields import SpeculativeFields
from megatron_async.config.parts import (
    CacheSizing, Communication, GraphSizing, KernelChoice, LoRASizing, Scheduling, Speculation,
)

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")
"""Accepted ``InferenceConfig.kv_cache_dtype`` values ("fp8" is "fp8_e4m3")."""
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance", "off")

DP_ENGINE_TIMEOUT_S = 30.0
"""Default of ``InferenceConfig.dp_engine_timeout_s`` and of the coordinator's ``--engine-timeout-s``."""
CPU_BUFFER_SIZE_GB = 1.0
"""KV pool budget on CPU (and of a context built from an unresolved config) when none is given."""


@dataclass
class InferenceConfig(KernelFields, CommunicationFields, SpeculativeFields, LoRAFields):
    """Configuration of the dynamic inference engine (fields of this class and of the groups it
    inherits).

    Sizes that are None are derived from the model and the other fields when the
    engine is built (see ``resolve``)."""

    block_size_tokens: int = 16
    """Tokens per paged KV block."""

    num_kv_blocks: int | None = None
    """Blocks in the KV pool (one of them the dummy block padding rows point at). None: from
    ``buffer_size_gb``, or on CUDA without it from ``gpu_memory_utilization``."""

    buffer_size_gb: float | None = None
    """KV pool budget in GB when ``num_kv_blocks`` is None. None: 1 GB on CPU; on CUDA the
    pool takes what ``gpu_memory_utilization`` leaves (``megatron_async/memory_planning.py``)."""

    gpu_memory_utilization: float = 0.9
    """CUDA, when neither ``num_kv_blocks`` nor ``buffer_size_gb`` is given: the share of the
    device's total memory this engine may use (vLLM's meaning). The KV pool (and nothing else)
    gets what is left of it after the memory other processes and the CUDA context hold, the
    weights, the measured peak of the largest step the configuration allows (a profiling
    forward at ``max_tokens`` with every sampling feature on) and the CUDA graph pools
    (estimated as one more such peak). ``LLM.memory_plan`` holds the numbers; the build fails
    with them when the model or one request of ``max_sequence_length`` does not fit."""

    max_requests: int = 64
    """Most requests that may be active (scheduled or paused) at once."""

    max_tokens: int = 2048
    """Most tokens one forward step may process (prefill chunk tokens + decode tokens)."""

    max_sequence_length: int = 4096
    """Most tokens (prompt + generated) any request may reach."""

    enable_chunked_prefill: bool = True
    """Split prompts longer than the per-step token budget over several steps.
    Off: a prompt must fit ``max_tokens`` whole, else it is rejected."""

    priority_aging: int = 16
    """``SamplingParams.priority``: a waiting request moves up one class for every this many
    requests admitted while it waits, so a low class still progresses."""

    enable_prefix_caching: bool = False
    """Share complete KV blocks between requests with equal prefixes and skip their prefill."""

    prefix_caching_mamba_gb: float = 0.0
    """Budget of the cached Mamba state pool for hybrid prefix caching; <= 0 disables it."""

    share_prompt_prefill: bool = True
    """Requests with the same prompt (the n samples of one prompt) prefill it once: the others wait
    for the first one's prefill, take its complete KV blocks and compute only the last partial
    block, with or without prefix caching (hybrid models: only with prefix caching and a Mamba
    state pool). Counted in ``EngineStats.prompt_shares`` / ``shared_prompt_tokens``."""

    kv_cache_dtype: str = "auto"
    """Element type of the paged KV pool: "auto" = the model's dtype; "fp8_e4m3" (or "fp8") =
    float8 e4m3, half of bf16's bytes, so twice the KV tokens in the same memory and half the
    bytes attention reads per key. Each layer stores x / scale per KV head with a fixed
    power-of-two scale of 1.0 (values beyond +-448 saturate), read back in registers by the
    attention kernels; prefix caching, chunked prefill, eviction, speculative verify and
    suspend / resume work unchanged. Costs accuracy (docs/PERFORMANCE.md, "FP8")."""

    async_scheduling: bool = True
    """Launch-ahead: step N+1 is enqueued on the device before step N's CPU bookkeeping."""

    cuda_graphs: bool | None = None
    """Capture and replay decode-only steps as CUDA graphs (CUDA only; ignored on CPU); with
    speculative decoding also its verify steps (decode rows with drafts, padded to a captured width).
    None: on for CUDA, off on CPU (``LLM.config`` holds the resolved value). False is vLLM's
    ``enforce_eager`` (the main job's ``--eager``): every step eager, no capture at startup."""

    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    """Padded decode batch sizes to capture. None: 1, 2, 4, 8, then multiples of 16 up to max_requests."""

    cuda_graph_mixed_steps: bool = True
    """With ``cuda_graphs``: also replay mixed steps (prefill chunks + decode rows, and any step
    with a multi-token row) as graphs keyed by padded token count. Needs Triton attention and
    no expert parallelism; hybrid (Mamba) models also need the TRITON or MAMBA_SSM Mamba backend
    (the packed kernels; the torch reference keeps mixed steps eager)."""

    cuda_graph_token_counts: tuple[int, ...] | None = None
    """Padded token counts of the mixed-step graphs. None: 16, 32, ..., 256, then four sizes
    per doubling (x1.25, x1.5, x1.75, x2) up to max_tokens (padding wastes at most 25%)."""

    cuda_graph_verify_widths: tuple[int, ...] | None = None
    """With ``cuda_graphs`` and speculative decoding: tokens per row of the verify graphs, each
    in 2 .. num_speculative_tokens + 1 (which is always included). A verify step replays the
    narrowest width that holds its most drafted row; rows with fewer drafts are padded inside
    the row. None: (2, K + 1): steps whose rows draft at most one token (probes of requests
    switched off by acceptance) replay narrow graphs, the rest full ones. More widths: less
    padding per step, more captures (sizes x variants per width)."""

    enable_suspend: bool = False
    """Allocate the weights, the KV / Mamba state pools and the CUDA graph pools so that
    ``engine.suspend`` can free them and ``engine.resume`` bring them back at the same addresses
    (graphs stay valid). CUDA needs the ``torch-memory-saver`` package (and the process started with
    its preload library in ``LD_PRELOAD`` to free graph pools too); CPU emulates it."""

    stream_text: bool = True
    """Fill ``RequestUpdate.new_text`` at every step (incremental detokenization of every
    running request: a few microseconds of host time per token). False: updates carry
    ``new_text=None`` and a request's text is decoded once, when it finishes (string stop
    words still decode their own requests as they go)."""

    logging_step_interval: int = 0
    """Log (and time, with one device sync) every N steps; 0 = never."""

    nvtx_ranges: bool = False
    """Wrap every stage in an NVTX range (off = no cost)."""

    gc_freeze: bool = False
    """At the end of the build, collect start-up's garbage and freeze what survives out of the
    cyclic collector's later collections (``gc.freeze``, ``inference/gc_pauses.py``): a full
    collection of an engine process's ~200,000 start-up objects stops the step loop for tens of
    milliseconds; frozen, one walks only what serving allocated. The freeze is the process's:
    everything alive then (the caller's objects too) stays until the engine closes, and a
    dropped, unclosed engine is never collected. On in the processes that exist to serve (the
    main job's script, ``python -m megatron_async.serve``, its engines behind a coordinator);
    off for ``LLM`` in a process of the caller's."""

    dp_routing: DpRouting = DpRouting.LOAD_BALANCED
    """Which data-parallel engine a new request goes to, wherever there are several: engines behind
    a coordinator (``LLM(..., listen=...)``, ``python -m megatron_async.coordinator``), and the ranks
    of one job under ``expert_parallel_size`` > 1 (rank 0 routes; a TP x EP job routes to its
    data-parallel ranks). ``load_balanced``: the most free request slots; ``first_prefix_block`` /
    ``longest_prefix``: the engine whose prefix cache holds the prompt's first block / the most
    leading blocks (then the most free); ``scored``: ``dp_routing_alpha`` x the held share of the
    prompt's blocks + (1 - alpha) x the free share of the slots. Ties go to the lowest engine
    index (registration order, or ``dp_rank``). What an engine holds is known from what was routed
    to it and what it reports evicted; the prefix policies need ``enable_prefix_caching`` (without
    it they route as ``load_balanced``). Multi-turn chat and GRPO groups (many requests sharing a
    long prompt) keep their prefix hits with ``longest_prefix`` or ``scored``; routing never
    changes a token."""

    dp_routing_alpha: float = 0.5
    """``dp_routing`` "scored": the weight of prefix affinity against free capacity, in [0, 1]."""

    dp_engine_timeout_s: float = DP_ENGINE_TIMEOUT_S
    """The coordinator an engine job starts (``LLM(..., listen=...)``, ``serve --listen``) declares
    an engine that sent nothing for this long dead (hung with its connection open): its requests
    are routed again or end with an error. Engines heartbeat every second, also during a step."""

    weight_transfer_timeout_s: float = 30.0
    """How long ``init_weight_transfer`` waits for every rank of the trainer's transfer group to
    join, and ``update_weights_from_distributed`` for the trainer's senders to begin, before it
    fails naming the address, the port and this timeout. The wait runs off the engine's step loop
    (generation and other admin calls go on); an ``init_weight_transfer`` call (or admin body) may
    pass its own ``timeout_s``, which then bounds the group's collectives too."""

    kv_transfer_backend: str = "auto"
    """Prefill/decode disaggregation (docs/DISAGGREGATION.md): how a prefill engine's KV blocks reach
    a decode engine: "auto" (NCCL between GPUs, CUDA IPC where both share one, gloo on CPU), "nccl",
    "gloo" or "ipc"."""

    kv_transfer_kernel: bool = True
    """Disaggregation on CUDA: gather and scatter a transfer's chunk of blocks over every layer in
    one Triton launch each (``kernels/triton_kv_chunk.py``) instead of one torch op per layer (the
    torch ops moved an 8B request's 648 MiB over NCCL in 15.9 ms, the kernel in 3.6 ms: ``python -m
    benchmarks kernel-times kv-chunks --nccl``). False: the torch ops."""

    kv_send_mid_step: bool = True
    """A prefill engine starts a ``kv_send`` while its step runs on the device, not only between
    steps (``disaggregation/mid_step.py``): a decode engine's imported request then waits for its
    blocks less than a long prompt's step (Qwen3-8B, 8 req/s of 1-8k-token prompts on two H200s:
    import posted -> admitted p50 231 -> 30 ms, TPOT p99 12.2 -> 10.9 ms; ``python -m benchmarks
    disagg``). While a request awaits its send, the host notices a step's end up to 1 ms later.
    False: sends start only between steps."""

    structured_outputs_backend: str = "auto"
    """Grammar library of ``SamplingParams.structured_outputs``: "auto" (xgrammar, and llguidance for
    what xgrammar serves badly: length-bounded JSON strings, long counted repetitions, Lark
    grammars), "xgrammar", "guidance" (llguidance) or "off" (such requests are refused, and no
    logits-only CUDA graphs are captured). The libraries are optional: ``pip install
    'megatron_async[structured]'``; a request whose library is missing is refused, naming it."""

    grammar_threads: int = 4
    """Threads each grammar library fills a step's token masks with."""

    seed: int = 1234
    """Seed of the engine's generator that gives seeds to requests that bring none."""

    def __post_init__(self):
        # str values of the enum fields (CLI, JSON) become their enums; ValueError on unknown ones
        for name, enum in _ENUM_FIELDS.items():
            setattr(self, name, enum(getattr(self, name)))

    def validate(self) -> None:
        """Raise ValueError on settings that cannot work (changes nothing)."""
        for name in ("block_size_tokens", "max_requests", "max_tokens", "max_sequence_length", "priority_aging"):
            if getattr(self, name) <= 0:
                raise ValueError(f"InferenceConfig.{name} must be positive, got {getattr(self, name)}")
        if self.buffer_size_gb is not None and self.buffer_size_gb < 0:
            raise ValueError(f"InferenceConfig.buffer_size_gb must be >= 0 or None, got {self.buffer_size_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"InferenceConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("InferenceConfig.num_kv_blocks must be at least 2 (one is the dummy block)")
        if self.max_tokens < self.max_requests:
            # every active request must be able to decode one token per step
            raise ValueError(
                f"InferenceConfig.max_tokens ({self.max_tokens}) must be >= max_requests ({self.max_requests})"
            )
        for name, enum in _ENUM_FIELDS.items():  # a value assigned after construction
            enum(getattr(self, name))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"InferenceConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.p2p_all_reduce_max_bytes < 0:
            raise ValueError(f"InferenceConfig.p2p_all_reduce_max_bytes must be >= 0, got {self.p2p_all_reduce_max_bytes}")
        if self.consensus_spin_us is not None and self.consensus_spin_us < 0:
            raise ValueError(f"InferenceConfig.consensus_spin_us must be >= 0 or None, got {self.consensus_spin_us}")
        if not 0.0 <= self.dp_routing_alpha <= 1.0:
            raise ValueError(f"InferenceConfig.dp_routing_alpha must be in [0, 1], got {self.dp_routing_alpha}")
        for name in ("dp_engine_timeout_s", "weight_transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"InferenceConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_loras", "max_lora_rank"):
            if self.enable_lora and getattr(self, name) <= 0:
                raise ValueError(f"InferenceConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"InferenceConfig.num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative_ngram_max < 1:
            raise ValueError(f"InferenceConfig.speculative_ngram_max must be >= 1, got {self.speculative_ngram_max}")
        if not 0.0 <= self.speculative_min_acceptance <= 1.0:
            raise ValueError("InferenceConfig.speculative_min_acceptance must be in [0, 1], "
                             f"got {self.speculative_min_acceptance}")
        K = self.num_speculative_tokens
        if self.cuda_graph_verify_widths is not None and not all(2 <= w <= K + 1 for w in self.cuda_graph_verify_widths):
            raise ValueError(f"InferenceConfig.cuda_graph_verify_widths must lie in 2 .. num_speculative_tokens + 1 "
                             f"({K + 1}), got {self.cuda_graph_verify_widths}")
        if self.startup_build_threads is not None and self.startup_build_threads < 0:
            raise ValueError(f"InferenceConfig.startup_build_threads must be >= 0, got {self.startup_build_threads}")
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"InferenceConfig.structured_outputs_backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, "
                             f"got {self.structured_outputs_backend!r}")
        if self.grammar_threads < 1:
            raise ValueError(f"InferenceConfig.grammar_threads must be >= 1, got {self.grammar_threads}")
        if self.speculative_probe_interval < 1 or self.speculative_max_batch_size < 0:
            raise ValueError("InferenceConfig.speculative_probe_interval must be >= 1 and "
                             "speculative_max_batch_size >= 0")

    def for_device(self, device_type: str) -> InferenceConfig:
        """This config with the device-dependent defaults filled in (a copy; self unchanged when
        nothing is None): ``cuda_graphs`` and ``speculative_adaptive`` on for CUDA only, and on
        CPU a 1 GB KV budget."""
        changes = {}
        if self.cuda_graphs is None:
            changes["cuda_graphs"] = device_type == "cuda"
        if self.speculative_adaptive is None:
            changes["speculative_adaptive"] = device_type == "cuda"
        if device_type != "cuda" and self.buffer_size_gb is None:
            changes["buffer_size_gb"] = CPU_BUFFER_SIZE_GB
        return replace(self, **changes) if changes else self

    @property
    def kv_budget_gb(self) -> float:
        """``buffer_size_gb``, or the CPU default for a config no device resolved."""
        return CPU_BUFFER_SIZE_GB if self.buffer_size_gb is None else self.buffer_size_gb

    @property
    def max_samples(self) -> int:
        """Most sampled positions in one step: every row one, plus its drafts."""
        return min(self.max_tokens, self.max_requests * (1 + self.num_speculative_tokens))

    # ------------------------------------------------------------------ the parts components read
    def cache_sizing(self) -> CacheSizing:
        """What the context (KV pool, request tables, Mamba states) is sized by."""
        return _part(CacheSizing, self)

    def scheduling(self) -> Scheduling:
        """What the engine, its scheduler and request validation read."""
        return _part(Scheduling, self)

    def speculation(self) -> Speculation:
        """What the speculative policy and the drafter read."""
        return _part(Speculation, self)

    def graph_sizing(self) -> GraphSizing:
        """What the CUDA graph plan and runner read."""
        return _part(GraphSizing, self)

    def kernels(self) -> KernelChoice:
        """Which kernels the model, the model runner and the forward batches use."""
        return _part(KernelChoice, self)

    def lora(self) -> LoRASizing:
        """How many LoRA adapters the model holds and their largest rank."""
        return _part(LoRASizing, self)

    def communication(self) -> Communication:
        """How tensor / expert parallel ranks exchange activations and agree on steps."""
        return _part(Communication, self)


_ENUM_FIELDS = {"attention_backend": AttentionBackend, "mamba_backend": MambaBackend,
                "sampling_backend": SamplingBackend, "tp_all_reduce": AllReduceBackend,
                "speculative_method": SpeculativeMethod, "dp_routing": DpRouting}


def _part(cls, config: InferenceConfig):
    """``cls`` filled from the same-named fields (or properties) of ``config``; enums normalized."""
    values = {f.name: getattr(config, f.name) for f in fields(cls)}
    for name, enum in _ENUM_FIELDS.items():
        if name in values:
            values[name] = enum(values[name])
    return cls(**values)
