"""EngineStats: counters that show what the engine really did (tests assert on them)."""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass, field

CONSENSUS_WINDOW = 4096
"""How many of the latest consensus rounds keep their own duration (for p50 / p99)."""


@dataclass
class EngineStats:
    steps: int = 0
    """Launches bookkept."""
    decode_steps: int = 0
    """Bookkept launches whose rows were all decode rows (single tokens, or verify rows: one
    token plus its drafts)."""
    prefill_steps: int = 0
    """Bookkept launches with at least one prefill chunk."""
    overlapped_steps: int = 0
    """Launches enqueued while an earlier launch was still un-bookkept."""
    overlapped_decode_steps: int = 0
    rejected_launches: int = 0
    """Launch-ahead attempts that found nothing to launch while requests were unfinished
    (async mode only; a rejection is not a drain when the landing step finishes everything)."""
    rejected_causes: Counter = field(default_factory=Counter)
    drains: int = 0
    """Bookkept launches that had no successor enqueued while unfinished requests remained
    after them: the device went idle until the host launched again. Serial mode drains at
    every step but the last; launch-ahead only where it could not launch ahead."""
    paused_steps: int = 0
    """``step()`` calls while generation was paused (``pause_generation``) that launched and
    landed nothing."""
    discarded_rows: int = 0
    """Launch-ahead rows dropped because their request finished one step earlier."""
    paused: int = 0
    evicted: int = 0
    recomputed_after_update: int = 0
    """Requests that gave back their KV at a weight update to recompute it with the new weights."""
    prefix_hit_tokens: int = 0
    """Prompt tokens whose prefill was skipped: prefix-cache hits and prompts shared while held."""
    admitted_out_of_order: int = 0
    """Admissions that passed a request queued before them (``SamplingParams.priority``, or one
    waiting for a shared prompt)."""
    held_steps: int = 0
    """Steps scheduled while a caller held requests (``Scheduler.hold``: the server holds a
    request body's places above its share while other bodies run)."""
    prompt_shares: int = 0
    """Requests that waited at admission for another request prefilling the same prompt
    (``InferenceConfig.share_prompt_prefill``)."""
    shared_prompt_tokens: int = 0
    """Prompt tokens those requests took from it instead of prefilling them (prefill tokens saved)."""
    mamba_states_stored: int = 0
    mamba_states_restored: int = 0
    mamba_states_evicted: int = 0
    finished_requests: int = 0
    """Requests that ended by length or stop condition."""
    rejected_requests: int = 0
    """Requests refused at add_request (InvalidRequestError)."""
    lora_requests: int = 0
    """Requests accepted at add_request that name a LoRA adapter (``SamplingParams.lora``)."""
    lora_free_steps: int = 0
    """LoRA engines: launched steps whose forward skipped the LoRA ops (no row had an adapter)."""
    long_tile_steps: int = 0
    """Steps assembled with the prefill attention's long-row launch (a row of ``LONG_TILE_MIN_QUERY``+
    query tokens; ``InferenceConfig.long_prefill_tiles``)."""
    aborted_requests: int = 0
    """Requests ended by engine.abort_request."""
    failed_requests: int = 0
    """Admitted requests ended with finish_reason "error" because preparing a step raised for them."""
    generated_tokens: int = 0
    prefill_tokens: int = 0
    mixed_step_tokens: int = 0
    """Tokens of the steps with a prefill chunk, their decode rows' included (the KV they write)."""
    mixed_kv_read_tokens: int = 0
    """KV tokens those steps' attention reads: each row's KV after the step (its cached prefix or
    context and its new tokens), summed over rows and steps (a mixed step's floor counts them)."""
    decode_wall_time: float = 0.0
    """Host wall time of engine steps that bookkept a decode-only launch (no sync needed)."""
    prefill_wall_time: float = 0.0
    consensus_rounds: int = 0
    """Per-step ZMQ exchanges among TP / EP ranks (one per step, plus one per idle check)."""
    consensus_time: float = 0.0
    """Host seconds spent in those exchanges (waiting for the slowest rank included)."""
    consensus_round_seconds: deque = field(default_factory=lambda: deque(maxlen=CONSENSUS_WINDOW))
    """Host seconds of each of the latest ``CONSENSUS_WINDOW`` exchanges (``consensus_us``)."""
    consensus_latency_seconds: deque = field(default_factory=lambda: deque(maxlen=CONSENSUS_WINDOW))
    """Of those exchanges, the part after the last rank arrived (the exchange's own cost; the
    rest was waiting for slower ranks); ``consensus_latency_us``. Ranks on one host only."""
    consensus_work_seconds: deque = field(default_factory=lambda: deque(maxlen=CONSENSUS_WINDOW))
    """Of those exchanges, the duration less the wait for the other ranks: this rank's own host
    work in each (``consensus_work_us``); clock-independent, unlike the latency above."""
    consensus_plain_rounds: int = 0
    """Exchanges that moved only this rank's record of ints through shared memory (nothing
    encoded: no news from rank 0, no upload from this rank)."""
    consensus_wire: object = None
    """Rank 0 of several ranks: the ``WireStats`` of its socket (frames it dropped, by reason;
    handshakes it refused; strangers' disconnects): what anyone but the job's ranks sent."""
    consensus_sleeps: int = 0
    """Shared-memory waits that outlasted the spin (``consensus_spin_us``) and slept: each
    wake-up costs tens of us."""
    consensus_overlapped_rounds: int = 0
    """Exchanges made while a launch was in flight (launch-ahead: agreeing on step N+1 while
    the device runs step N, off the device's critical path unless host work outlasts it)."""
    dummy_steps: int = 0
    """Data-parallel engines: steps where this rank had nothing to launch while another rank
    did, so it ran a dummy forward (its collectives must match the others')."""
    spec_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified (rows discarded by a finish not counted)."""
    spec_accepted_tokens: int = 0
    """Of those, drafts accepted (each brought one token beyond plain decoding's one per row)."""
    spec_verify_rows: int = 0
    """Decode rows that verified at least one draft."""
    spec_draft_tokens_per_depth: list = field(default_factory=list)
    """Index d: verify rows with at least d + 1 drafts."""
    spec_accepted_tokens_per_depth: list = field(default_factory=list)
    """Index d: rows whose draft d + 1 was accepted (so were drafts 1..d)."""
    spec_truncated_rows: int = 0
    """Verify rows whose request finished (EOS, stop sequence, length) before the row's last
    emitted token: the tokens after the finish were dropped."""
    spec_off_rows: Counter = field(default_factory=Counter)
    """Decode rows run without drafts although speculation is on, by cause: "acceptance" (the
    request's acceptance fell below speculative_min_acceptance), "batch" (more decode rows than
    speculative_max_batch_size), "penalties" (penalties / min_tokens), "grammar" (structured outputs), "stale" (its previous
    launch was a plain step, so it has no drafts for this row)."""
    spec_plain_steps: int = 0
    """Decode steps of a speculative engine launched as plain steps: no row drafted in them and
    none could draft next, so they ran the plain engine's step (and replayed its decode graphs)
    without the drafter or any speculative state work (speculative/plain_steps.py)."""
    spec_plain_mixed_steps: int = 0
    """Steps with prefill chunks of a speculative engine launched as plain steps (the same rule;
    they replay a plain engine's mixed graphs)."""
    grammar_steps: int = 0
    """Launches with grammar rows (structured outputs): their forward was enqueued first and their
    sampling once the host had filled the token masks (engines/grammar_masks.py)."""
    grammar_rows: int = 0
    """Constrained samples in those launches."""
    grammar_fill_time: float = 0.0
    """Host seconds advancing grammars and filling their masks (the device runs the forward meanwhile)."""
    grammar_early_fills: int = 0
    """Of those launches, the ones whose masks were filled on the worker thread as soon as the
    launch before landed, while the engine thread scheduled the next launch."""
    grammar_fill_wait_time: float = 0.0
    """Engine-thread seconds waiting for those fills to end."""
    fast_decode_snapshots: int = 0
    """Decode steps whose host snapshot came from the per-request rows (contexts/decode_rows.py)
    instead of the general row-by-row assembly; in a speculative engine, its steps without drafts."""
    fast_landings: int = 0
    """Launches landed without drafts, one sample per row (engines/request_book.py): every
    launch of a plain engine, those without drafts of a speculative engine."""
    warmup_seconds: float = 0.0
    """Wall time of ``engine.warmup()`` (Triton builds + graph captures before serving)."""
    warmup_memory_bytes: int = 0
    """Device memory the warm-up reserved (graph pools, sampler state)."""
    warmup_graphs: int = 0
    """CUDA graphs captured by the warm-up."""
    warmup_triton_builds: int = 0
    """Triton kernel builds during the warm-up."""
    graph_captures_after_warmup: int = 0
    """CUDA graphs captured while serving, after the warm-up (0 when the warm-up covered every
    key; without a warm-up, every lazy capture counts)."""
    gc_collections: int = 0
    """Python's cyclic garbage collections in this process since the last engine of it finished
    its start-up (``gc_pauses.py``; with ``InferenceConfig.gc_freeze`` what start-up built is
    frozen out of them)."""
    gc_full_collections: int = 0
    """Of those, of the oldest generation."""
    gc_pause_seconds: float = 0.0
    """Their time: every thread of the process stood still, the step loop's too."""
    gc_pause_max_seconds: float = 0.0
    triton_builds_after_warmup: int = 0
    """Triton kernel builds in this process since the warm-up ended (every engine of the
    process counts: Triton's build hook is process-wide). 0 without a warm-up or without Triton."""
    graph_replays: int = 0
    """Steps that replayed a CUDA graph."""
    mixed_graph_replays: int = 0
    """Of those, mixed steps (prefill chunks + decode rows)."""
    lora_free_graph_replays: int = 0
    """Of those, replays of a LoRA engine's LoRA-free decode graphs (``GraphKey.no_lora``)."""
    long_tile_graph_replays: int = 0
    """Of those, replays of long-tile mixed graphs (``GraphKey.long_tiles``)."""
    spec_graph_replays: int = 0
    """Of those, speculative verify steps (decode rows with drafts, each laid out as W tokens
    and samples, W a captured verify width): verify graphs."""
    timed_steps: int = 0
    timed_device_time: float = 0.0
    """Event-to-event time of logging steps (CUDA events recorded before the step's H2D copy and
    after its sample copy): a step period, not device busy time, since it also holds any wait
    behind the previous launch and host enqueue time. Device idle is measured from profiler
    intervals (benchmarks/gpu_idle.py)."""

    @property
    def mean_decode_step_ms(self) -> float:
        return 1e3 * self.decode_wall_time / self.decode_steps if self.decode_steps else 0.0

    @property
    def mean_prefill_step_ms(self) -> float:
        return 1e3 * self.prefill_wall_time / self.prefill_steps if self.prefill_steps else 0.0

    @property
    def consensus_us_per_round(self) -> float:
        return 1e6 * self.consensus_time / self.consensus_rounds if self.consensus_rounds else 0.0

    def consensus_us(self, percentile: float) -> float:
        """A percentile (0-100) of the latest exchanges' durations in us; 0 without any."""
        return _percentile_us(self.consensus_round_seconds, percentile)

    def consensus_latency_us(self, percentile: float) -> float:
        """A percentile of the latest exchanges' own cost (after the last rank arrived) in us."""
        return _percentile_us(self.consensus_latency_seconds, percentile)

    def consensus_work_us(self, percentile: float) -> float:
        """A percentile of the latest exchanges' own host work (duration less waiting) in us."""
        return _percentile_us(self.consensus_work_seconds, percentile)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 without drafts)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def overlap_ratio(self) -> float:
        return self.overlapped_decode_steps / self.decode_steps if self.decode_steps else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rejected_causes"] = dict(self.rejected_causes)
        del d["consensus_round_seconds"], d["consensus_latency_seconds"], d["consensus_work_seconds"]
        d["consensus_work_p50_us"] = self.consensus_work_us(50)
        d["consensus_p50_us"] = self.consensus_us(50)
        d["consensus_p99_us"] = self.consensus_us(99)
        d["consensus_latency_p50_us"] = self.consensus_latency_us(50)
        d["consensus_latency_p99_us"] = self.consensus_latency_us(99)
        d["spec_off_rows"] = dict(self.spec_off_rows)
        d["spec_acceptance_rate"] = self.spec_acceptance_rate
        d["mean_decode_step_ms"] = self.mean_decode_step_ms
        d["mean_prefill_step_ms"] = self.mean_prefill_step_ms
        d["overlap_ratio"] = self.overlap_ratio
        d["consensus_us_per_round"] = self.consensus_us_per_round
        return d


def nearest_rank(values, percentile: float) -> float:
    """The ``percentile`` (0..100) of ``values`` by nearest rank; 0.0 when there are none."""
    xs = sorted(values)
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, int(percentile / 100 * len(xs)))]


def _percentile_us(seconds, percentile: float) -> float:
    return 1e6 * nearest_rank(seconds, percentile)
