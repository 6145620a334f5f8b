"""InferenceConfig: every knob of the engine, one documented field each."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from megatron_async.config.modes import (
    AllReduceBackend, AttentionBackend, DpRouting, MambaBackend, SamplingBackend, SpeculativeMethod,
)
from megatron_async.config.parts import CacheSizing, Communication, GraphSizing, KernelChoice, Scheduling, Speculation

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")
"""Accepted ``InferenceConfig.kv_cache_dtype`` values ("fp8" is "fp8_e4m3")."""
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance", "off")

DP_ENGINE_TIMEOUT_S = 30.0
"""Default of ``InferenceConfig.dp_engine_timeout_s`` and of the coordinator's ``--engine-timeout-s``."""
CPU_BUFFER_SIZE_GB = 1.0
"""KV pool budget on CPU (and of a context built from an unresolved config) when none is given."""


@dataclass
class InferenceConfig:
    """Configuration of the dynamic inference engine.

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
    the usable cores, at most 16 (one rank alone; under tensor / expert parallelism 0); 0: build
    each kernel when a warm-up step first meets it."""

    enable_suspend: bool = False
    """Allocate the weights, the KV / Mamba state pools and the CUDA graph pools so that
    ``engine.suspend`` can free them and ``engine.resume`` bring them back at the same addresses
    (graphs stay valid). CUDA needs the ``torch-memory-saver`` package (and the process started with
    its preload library in ``LD_PRELOAD`` to free graph pools too); CPU emulates it."""

    attention_backend: AttentionBackend = AttentionBackend.AUTO
    """Attention kernels to use (and the MoE experts' kernels: Triton fused MoE or the torch loop)."""

    mamba_backend: MambaBackend = MambaBackend.AUTO
    """SSM kernels to use for hybrid models."""

    stream_text: bool = True
    """Fill ``RequestUpdate.new_text`` at every step (incremental detokenization of every
    running request: a few microseconds of host time per token). False: updates carry
    ``new_text=None`` and a request's text is decoded once, when it finishes (string stop
    words still decode their own requests as they go)."""

    sampling_backend: SamplingBackend = SamplingBackend.AUTO
    """Sampling (penalties, temperature, top-k / top-p / min-p, draws) implementation."""

    logging_step_interval: int = 0
    """Log (and time, with one device sync) every N steps; 0 = never."""

    nvtx_ranges: bool = False
    """Wrap every stage in an NVTX range (off = no cost)."""

    batch_invariant: bool = False
    """Batch-invariant numerics: a request's logits (so its tokens and log-probs) are bit
    for bit the same whatever else shares its steps, however its prompt was chunked, with or
    without CUDA-graph padding, prefix-cache hits or launch-ahead. Every matmul runs a
    fixed-tile Triton kernel, RMSNorm / log-softmax reduce each row alone, attention walks
    each row's keys in one fixed order (the same kernel for prefill and decode), and the TP
    sum adds ranks in a fixed order (same TP size only). Models of attention and MLP blocks
    (GPT; not Mamba2 layers); needs Triton (CUDA, or
    CPU with ``TRITON_INTERPRET=1``). Costs throughput; off = today's kernels, no extra work."""

    tp_all_reduce: AllReduceBackend = AllReduceBackend.AUTO
    """Tensor-parallel all-reduce of small messages (decode activations). ``auto`` / ``p2p``: one kernel that reads
    every rank's copy through CUDA P2P mappings of a symmetric buffer (torch symmetric memory,
    never NVLink multicast) instead of NCCL's ring / tree round trips; CUDA-graph safe. Larger
    messages, other dtypes and CPU runs use NCCL / gloo. Under ``batch_invariant`` the TP sum
    keeps its fixed-order all-gather either way. Default ``auto``: the P2P path beats NCCL per
    decode all-reduce in graphs and per Qwen3-8B TP=4 decode step (docs/PERFORMANCE.md, "Tensor
    parallelism"). bf16 sums of 3+ ranks then add
    in another order than NCCL's ring, so bf16 tokens can differ from an NCCL run's at near-ties."""

    tp_fused_norm: bool = True
    """With the P2P all-reduce (``tp_all_reduce`` auto / p2p on GPUs): the all-reduce after each
    attention / MLP / Mamba2 output projection runs in one kernel with the residual add and the
    next block's RMSNorm (kernels/triton_fused_all_reduce.py), 2 fewer launches per layer and
    one less trip of the hidden state through memory. Decode-size messages only (larger ones,
    bias, a float32 residual stream, batch-invariant mode: unfused). bf16 partials are summed
    in float32 and rounded once, so bf16 bits can differ from the unfused P2P path (float32:
    the same). False: the unfused all-reduce then add + RMSNorm (A/B)."""

    ep_p2p_exchange: bool = True
    """Expert parallelism on GPUs of one host: the MoE layers' all-gather and reduce-scatter of
    decode-size messages (<= 16 MB) run as one Triton kernel each over symmetric buffers
    (``parallel/p2p_exchange.py``: CUDA P2P, never multicast) instead of NCCL, whose fixed cost
    per collective dominates these; larger ones, CPU / gloo, or a group that fails the load-time
    self-test use NCCL. bf16 partial outputs are summed in float32 in rank order and rounded
    once (NCCL adds in its own order), so bf16 tokens can differ from an NCCL run's at near-ties.
    False: NCCL for every size (A/B)."""

    p2p_all_reduce_max_bytes: int = 8 << 20
    """Largest message (bytes) the P2P all-reduce takes; larger ones go to NCCL. Each rank
    allocates one symmetric buffer of this size. 0 turns the P2P path off."""

    consensus_shared_memory: bool = True
    """Tensor / expert parallel: when every rank runs on one host (decided by all ranks together
    when the engine is built), the per-step consensus moves its ints through a shared-memory slot
    per rank instead of a ZMQ round trip through rank 0 (tens of us instead of hundreds; x86
    only). Ranks on several hosts, or off on any rank: ZMQ. ``LLM.communicator.exchange_path``
    says which is used."""

    consensus_spin_us: float | None = None
    """How long a rank waiting in the shared-memory consensus spins (yielding its core every
    turn) before it sleeps in the kernel (waking costs tens of us more than spinning). None:
    2000 when the host has a spare core per rank (cores >= 1-minute load average + ranks, as
    on a GPU host: a waiting rank has nothing else to do), else 20: on a busy or small host a
    yielding spinner waits behind every other runnable task, while a sleeper woken by its peer
    preempts them (measured on 2 loaded cores: ~1.3 ms vs ~0.24 ms to notice the last rank)."""

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

    kv_transfer_backend: str = "auto"  # prefill -> decode KV: auto | nccl | gloo | ipc (docs/DISAGGREGATION.md)

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

    num_speculative_tokens: int = 0
    """Draft tokens verified per decode row and step (0 = speculative decoding off). A decode
    row then runs its last token plus up to this many drafts in one forward and keeps the
    drafts that equal what the model samples at their positions (with the same per-position
    draws), plus one more token: tokens and log-probs are those of plain decoding."""

    speculative_method: SpeculativeMethod = SpeculativeMethod.MTP
    """Drafter: "mtp" (the checkpoint's MTP heads) or "ngram" (prompt lookup, no weights)."""

    speculative_ngram_max: int = 3
    """N-gram drafter: the longest suffix (in tokens) looked up in the request's history;
    shorter suffixes down to one token are tried when it has no earlier occurrence."""

    speculative_min_acceptance: float = 0.3
    """A request whose recent draft acceptance (moving average of accepted / drafted) falls
    below this decodes without drafts, probing again with one draft every
    ``speculative_probe_interval`` steps; 0 = never switch off by acceptance. Not with
    ``speculative_adaptive`` (its per-step rule switches drafting off where it does not pay)."""

    speculative_probe_interval: int = 16
    """Decode rows a request runs without drafts, once switched off, before it probes again."""

    speculative_max_batch_size: int = 0
    """Steps with more decode rows than this run without drafts (verify costs more than it
    saves once the forward is compute bound); 0 = no limit."""

    speculative_adaptive: bool | None = None
    """Decide per step, from measured step costs, whether drafting pays: a step verifies drafts
    at width W only when the rows' expected tokens per row (from their acceptance) exceed what a
    W-wide verify step costs over a plain step at this batch size (speculative/policy.py). None:
    on for CUDA, off on CPU (where step time follows the token count and the tests exercise the
    drafting itself) and under tensor / expert parallelism (ranks schedule alike; their timings
    differ); False: rows draft whenever their acceptance allows."""

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
        if not self.dp_engine_timeout_s > 0:
            raise ValueError(f"InferenceConfig.dp_engine_timeout_s must be > 0, got {self.dp_engine_timeout_s}")
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
