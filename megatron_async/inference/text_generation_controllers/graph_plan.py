"""Which CUDA graphs exist: the key of a step, and the full list warm-up captures.

Pure host logic (no CUDA), so CPU tests check that every step serving can produce maps to a
key warm-up captured. A key is (padded tokens, padded rows, decode-only, sampling variant).

Sampling variants form a chain, each a superset of the one before, because every sampling
feature is also switched per row at run time (a row's own off values: temperature 0 = greedy,
top-k 0, top-p 0, no penalty slot): a graph of a larger variant computes the same tokens for a
step that needs less. A step replays the smallest variant that covers it, so the key space is
sizes x 5 (decode) or x 4 (mixed, verify) instead of sizes x every flag combination:
- GREEDY: argmax;
- TEMPERATURE: the Gumbel draw (greedy rows still argmax);
- NUCLEUS: + top-p and min-p; decode graphs only (a mixed or verify step replays FILTERED, its
  sampling a small part of the step);
- FILTERED: + the top-k threshold search (rows without top-k skip its work, yet its seven
  launches cost a top-p decode step ~14 us at a 32,000-token vocabulary, ~30 at 151,936);
- FULL: + penalties / min_tokens and log-probs with the top ``GRAPH_TOP_N`` (a row's own
  top-n is the head of that sorted list).

Log-probs are a second, orthogonal dimension for decode graphs: each variant below FULL has a
log-prob twin (``GraphKey.log_probs``) that runs that variant's sampling plus the log-prob
statistics and the top ``GRAPH_TOP_N``, so a greedy or temperature step asking for log-probs
does not pay for penalties and filter stages it does not use (the FULL variant's penalty pass
reads and writes the [R, V] logits and count rows; the log-prob kernels read the logits once).
The twins cost 4 decode graphs per decode size (workload A's plan: 48 of its 208 graphs, small
ones). Mixed and verify steps asking for log-probs replay FULL (their sampling is a small part
of the step), and so do data-parallel engines' steps (the ranks agree on one chain index).

Mixed steps (any row with more than one token: prefill chunks) pad their tokens to a bucket
of ``token_counts``; their rows pad to ``min(max_requests, padded tokens) + 1``, one spare row
at least, which takes the padding tokens (see ``DynamicInferenceContext.pad_for_graph``).

Speculative verify steps (decode rows, some with drafts) replay verify graphs: every row is
exactly ``W`` tokens and ``W`` samples, W the narrowest captured width (``InferenceConfig.
cuda_graph_verify_widths``, default 2 and K + 1) that holds the step's most drafted row; rows
with fewer drafts (none, a probe, a length limit) are padded inside the row, rows padded to a
decode batch size (``DynamicInferenceContext.initialize_attention_state(verify_width=W)``).
A row's padding costs tokens of a forward that is memory bound at the batch sizes where
speculation pays, while a key per draft count multiplies the captures; width 2 keeps steps
where requests switched off by acceptance probe with one draft from paying for K + 1 tokens.
A verify step that mixes in a prefill chunk runs eager (a hybrid's window layout then needs
host lists); a step whose rows all run without drafts replays a decode graph.

Steps with grammar rows (structured outputs) sample only once the host has filled their token
masks, so they replay logits-only graphs (``GraphKey.logits_only``: the forward up to the
samples' logits, one per decode size and mixed token count) and sample eagerly; none in a
speculative engine (its grammar steps run eager). A plain engine's decode and mixed graphs are
sampling tails replayed after the logits-only graph of their sizes (cuda_graphs.py,
``split_sampling``), so its plan holds the logits-only keys whether or not grammars are served.

A speculative engine's graphs run its speculative machinery (``GraphKey.spec``: spec inputs,
acceptance, drafter); its decode and mixed steps that need none of it (speculative/plain_steps.py)
replay decode and mixed graphs without it, under the same keys as a plain engine's (mixed
graphs of both kinds: a mixed step needs the machinery where rows beside its prefill chunks
continue a verify launch, or drafts follow it).

A LoRA engine's decode graphs have LoRA-free twins (``GraphKey.no_lora``: the forward without the
adapters' ops, ``lora_free``), replayed by decode steps where no row has an adapter: the few
hundred launches a step of the adapted linears cost ~1 ms against an 8B model's ~5-8 ms decode
step. Decode sizes only: a mixed step's forward is long enough that they cost ~1 % of it, and
mixed forwards are the plan's largest captures; verify and data-parallel graphs keep LoRA."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import Enum

from megatron_async.config import GraphSizing
from megatron_async.inference.sampling_params import GRAMMAR, LOG_PROBS, MIN_P, PENALTIES, SAMPLED, TOP_K, TOP_P

GRAPH_TOP_N = 20
"""Top-n log-probs a FULL graph computes (OpenAI's limit); steps asking for more run eager."""


class SamplingVariant(str, Enum):
    GREEDY = "greedy"
    TEMPERATURE = "temperature"
    NUCLEUS = "nucleus"
    FILTERED = "filtered"
    FULL = "full"


@dataclass(frozen=True)
class VariantFlags:
    """The StepShape sampling flags a variant's graph is captured with."""

    any_sampling: bool
    filters: tuple[bool, bool, bool]
    any_log_probs: bool
    max_top_n: int
    any_penalties: bool


def variant_flags(variant: SamplingVariant, vocab_size: int, log_probs: bool = False) -> VariantFlags:
    """``log_probs``: the variant's log-prob twin (FULL computes log-probs either way)."""
    order = variant_index(variant)
    full = variant == SamplingVariant.FULL
    lp = full or log_probs
    top_k = order >= variant_index(SamplingVariant.FILTERED)
    return VariantFlags(any_sampling=order >= 1, filters=(top_k, order >= 2, order >= 2), any_log_probs=lp,
                        max_top_n=min(GRAPH_TOP_N, vocab_size) if lp else 0, any_penalties=full)


def _needs(max_top_n: int, penalties: bool, log_probs: bool, filtered: bool, sampled: bool,
           top_k: bool) -> tuple[SamplingVariant, bool] | None:
    """(the smallest variant covering the sampling, log-probs apart; whether log-probs are
    needed), None when no graph computes that many top log-probs."""
    if max_top_n > GRAPH_TOP_N:
        return None
    if penalties:
        variant = SamplingVariant.FULL
    elif filtered:
        variant = SamplingVariant.FILTERED if top_k else SamplingVariant.NUCLEUS
    else:
        variant = SamplingVariant.TEMPERATURE if sampled else SamplingVariant.GREEDY
    return variant, log_probs or max_top_n > 0


def sampling_needs(shape) -> tuple[SamplingVariant, bool] | None:
    """A step's (variant without log-probs, needs log-probs); None: no graph covers it."""
    return _needs(shape.max_top_n, shape.any_penalties, shape.any_log_probs, any(shape.filters), shape.any_sampling,
                  shape.filters[0])


def _chain(needs: tuple[SamplingVariant, bool] | None) -> SamplingVariant | None:
    """The smallest variant of the chain alone (log-probs: FULL) covering ``needs``."""
    if needs is None:
        return None
    return SamplingVariant.FULL if needs[1] else needs[0]


def variant_of(shape) -> SamplingVariant | None:
    """The smallest chain variant covering a step's sampling needs (None: no graph can, run
    eager); log-probs need FULL here (no twins)."""
    return _chain(sampling_needs(shape))


def variant_of_params(params) -> SamplingVariant | None:
    """``variant_of`` a step from its rows' SamplingParams, before the step is assembled (their
    ``SamplingParams.features``, as the snapshot builders derive the step's flags). None too for
    a step with grammar rows (its sampling runs eager)."""
    bits = top_n = 0
    for sp in params:
        bits |= sp.features()
        top_n = max(top_n, sp.top_n_logprobs)
    if bits & GRAMMAR:
        return None
    return _chain(_needs(top_n, bool(bits & PENALTIES), bool(bits & LOG_PROBS), bool(bits & (TOP_K | TOP_P | MIN_P)),
                         bool(bits & SAMPLED), bool(bits & TOP_K)))


def variant_index(variant: SamplingVariant) -> int:
    """Position in the chain (larger covers smaller): data-parallel ranks agree on the max."""
    return list(SamplingVariant).index(variant)


@dataclass(frozen=True)
class GraphKey:
    num_tokens: int
    """Padded token count (decode: = rows)."""
    num_rows: int
    """Padded row count."""
    decode_only: bool
    variant: SamplingVariant
    verify_width: int = 0
    """> 0: a verify graph; every row is this many tokens and samples (its last token, drafts)."""
    spec: bool = False
    """The step runs speculative decoding's machinery (spec inputs, acceptance, the drafter);
    False: a plain engine's step (also a speculative engine's plain decode steps)."""
    log_probs: bool = False
    """A decode graph's log-prob twin: its variant's sampling plus the log-probs and the top
    ``GRAPH_TOP_N`` (never set on FULL, which computes them anyway)."""

    logits_only: bool = False
    """The forward up to the samples' logits, no sampling (steps with grammar rows; variant GREEDY)."""
    no_lora: bool = False
    """A LoRA engine's decode graph without the adapters' ops, for steps where no row has one."""

    @property
    def label(self) -> str:
        """The sampling the graph runs: the variant's name, "+log_probs" for a twin."""
        if self.logits_only:
            return "logits" + "-lora" * self.no_lora
        return self.variant.value + "+log_probs" * self.log_probs + "-lora" * self.no_lora


def default_batch_sizes(max_requests: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_requests]
    sizes += list(range(16, max_requests + 1, 16))
    if sizes[-1] != max_requests:
        sizes.append(max_requests)
    return sizes


def decode_batch_sizes(config: GraphSizing) -> list[int]:
    """The row counts decode graphs are captured at: as configured, or ``default_batch_sizes``."""
    return sorted(config.cuda_graph_batch_sizes or default_batch_sizes(config.max_requests))


def splits_sampling(config: GraphSizing, collective: bool) -> bool:
    """Whether decode and mixed steps replay a forward graph and a sampling tail
    (``CudaGraphRunner.split_sampling``): plain engines; speculative engines (the drafter reads the
    forward's hidden states) and data-parallel ones (``collective``) capture whole steps."""
    return not collective and config.num_speculative_tokens == 0


def default_token_counts(max_tokens: int) -> list[int]:
    """16 .. 256 by doubling, then four steps per doubling, capped by (and ending at) max_tokens."""
    counts, p = [], 16
    while p < 256:
        counts.append(p)
        p *= 2
    while p < max_tokens:
        counts += [p, p * 5 // 4, p * 3 // 2, p * 7 // 4]
        p *= 2
    return sorted({c for c in counts if c < max_tokens} | {max_tokens})


class GraphPlan:
    """The graphs a configuration can replay. ``mixed``: mixed-step graphs are possible (the
    runner decides from the model and backends); ``variants``: the sampling variants that
    may be captured."""

    def __init__(self, config: GraphSizing, vocab_size: int, mixed: bool,
                 variants: tuple[SamplingVariant, ...] = tuple(SamplingVariant), verify: bool = False,
                 plain_steps: bool = False, log_prob_twins: bool = True, logits_only: bool = False,
                 collective: bool = False, lora_free: bool = False):
        """``verify``: verify graphs for speculative decoding (``num_speculative_tokens`` > 0).
        ``plain_steps``: a speculative engine's decode and mixed steps may run plain (decode and
        mixed graphs of both kinds). ``log_prob_twins``: decode graphs of the variants below FULL have
        log-prob twins (off: every log-prob step replays FULL). ``logits_only``: logits-only
        graphs for steps with grammar rows (not with speculative decoding). ``collective``:
        data-parallel engines, whose mixed graphs are ``collective_mixed_tokens``' sizes, FULL only.
        ``lora_free``: a LoRA engine whose steps without adapter rows skip the LoRA ops: its
        decode graphs have LoRA-free twins (not for data-parallel engines)."""
        self.collective = collective
        self.lora_free = lora_free and not collective
        self.log_prob_twins = log_prob_twins
        self.config = config
        self.speculative = config.num_speculative_tokens > 0
        """Every graph but the plain decode graphs runs the speculative machinery."""
        self.plain_steps = plain_steps and self.speculative
        self.logits_only = logits_only and not self.speculative
        self.vocab_size = vocab_size
        self.decode_sizes = decode_batch_sizes(config)
        counts = config.cuda_graph_token_counts or default_token_counts(config.max_tokens)
        self.token_counts = sorted(c for c in counts if c <= config.max_tokens) if mixed else []
        if collective:  # a step of at most a decode batch's tokens replays a decode graph (or runs eager)
            self.token_counts = [c for c in self.token_counts if c > self.decode_sizes[-1]]
        self.variants = variants
        K = config.num_speculative_tokens
        widths = config.cuda_graph_verify_widths or (2, K + 1)
        self.verify_sizes: dict[int, list[int]] = {}
        """Verify width -> padded row counts of its graphs (their tokens fit ``max_tokens``)."""
        if verify and K > 0:
            for w in sorted(set(widths) | {K + 1}):
                sizes = [b for b in self.decode_sizes if b * w <= config.max_tokens]
                if sizes:
                    self.verify_sizes[w] = sizes

    def verify_width(self, plan) -> int:
        """The row width of the verify graph ``plan`` (a StepPlan) replays, 0 when its step
        cannot replay one: the step must be decode rows only (one token plus drafts each), some
        with drafts, few enough for a verify size of a width holding the most drafted row. The
        runner then lays the step out uniformly at that width."""
        rows = plan.rows
        if not self.verify_sizes or not plan.is_all_decode:
            return 0
        need = 1 + max(r.num_drafts for r in rows)
        if need == 1:
            return 0
        return next((w for w, sizes in self.verify_sizes.items() if w >= need and sizes[-1] >= len(rows)), 0)

    def collective_mixed_tokens(self, num_tokens: int) -> int | None:
        """Data-parallel engines: the tokens of the mixed graph every rank replays in a step whose
        largest launch (any rank's) has ``num_tokens`` tokens; None where no mixed graph is
        replayed: up to the largest decode batch (a decode graph of that size, or eager for a
        rank with a prefill chunk) and above the largest mixed graph (eager). Every rank derives
        it from the agreed count alone, so all replay graphs of one size: their MoE exchanges,
        padded to the graph's tokens, match. Ranks whose own step is decode rows or nothing
        replay the same graph with their rows and padding."""
        if not self.collective or not self.token_counts or num_tokens > self.token_counts[-1]:
            return None
        if num_tokens <= self.decode_sizes[-1]:
            return None
        return self.token_counts[bisect.bisect_left(self.token_counts, num_tokens)]

    def collective_mixed_key(self, num_tokens: int) -> GraphKey | None:
        """The key of ``collective_mixed_tokens``' graph (FULL sampling: a larger variant draws the
        same tokens, so one variant serves every rank's rows), None where there is none."""
        tokens = self.collective_mixed_tokens(num_tokens)
        if tokens is None or SamplingVariant.FULL not in self.variants:
            return None
        return GraphKey(tokens, self.mixed_rows(tokens), False, SamplingVariant.FULL)

    def mixed_rows(self, padded_tokens: int) -> int:
        """Rows of a mixed graph of ``padded_tokens``: every real row fits (a row has >= 1 token)
        plus at least one spare row for the padding tokens."""
        return min(self.config.max_requests, padded_tokens) + 1

    def key(self, shape, min_rows: int = 0, min_variant: int = 0, spec: bool | None = None) -> GraphKey | None:
        """The graph a step replays (None: eager). ``min_rows`` / ``min_variant``: data-parallel
        ranks pad decode steps at least to the rows, and replay at least the sampling variant,
        that all ranks agreed on (a larger variant draws the same tokens). ``spec``: whether
        the step runs the speculative machinery (None: whenever speculation is on); only
        decode and mixed steps of a plan with ``plain_steps`` can run without it."""
        spec = self.speculative if spec is None or not self.plain_steps else spec
        if shape.any_grammar:
            return self._logits_key(shape, min_rows)
        needs = sampling_needs(shape)
        if needs is None:
            return None
        variant, log_probs = needs
        variant = list(SamplingVariant)[max(variant_index(variant), min_variant)]
        verify = bool(shape.verify_width) or shape.num_samples > shape.num_rows
        twin = log_probs and variant != SamplingVariant.FULL
        if twin and not (self.log_prob_twins and shape.is_decode_only and not verify):
            variant, twin = SamplingVariant.FULL, False
        if variant == SamplingVariant.NUCLEUS and not (shape.is_decode_only and not verify):
            variant = SamplingVariant.FILTERED
        if variant not in self.variants:
            return None
        if min_rows and not verify and max(shape.num_tokens, min_rows) > self.decode_sizes[-1]:
            return self.collective_mixed_key(max(shape.num_tokens, min_rows))  # data-parallel ranks
        if verify:  # speculative verify rows
            W = shape.verify_width
            if W not in self.verify_sizes or min_rows:
                return None  # not a uniform layout of a captured width (a prefill chunk beside them: eager)
            sizes = self.verify_sizes[W]
            i = bisect.bisect_left(sizes, shape.num_rows)
            return GraphKey(sizes[i] * W, sizes[i], False, variant, W, True) if i < len(sizes) else None
        if shape.is_decode_only:
            rows = max(shape.num_rows, min_rows)
            if rows > self.decode_sizes[-1]:
                return None
            padded = self.decode_sizes[bisect.bisect_left(self.decode_sizes, rows)]
            return GraphKey(padded, padded, True, variant, spec=spec, log_probs=twin, no_lora=self._no_lora(shape))
        if not self.token_counts or shape.num_tokens > self.token_counts[-1] or min_rows:
            return None
        tokens = self.token_counts[bisect.bisect_left(self.token_counts, shape.num_tokens)]
        return GraphKey(tokens, self.mixed_rows(tokens), False, variant, spec=spec)

    def _logits_key(self, shape, min_rows: int) -> GraphKey | None:
        """The logits-only graph of a step with grammar rows (None: eager)."""
        if not self.logits_only or min_rows or shape.verify_width or shape.num_samples > shape.num_rows:
            return None
        greedy = SamplingVariant.GREEDY
        if shape.is_decode_only:
            if shape.num_rows > self.decode_sizes[-1]:
                return None
            padded = self.decode_sizes[bisect.bisect_left(self.decode_sizes, shape.num_rows)]
            return GraphKey(padded, padded, True, greedy, logits_only=True, no_lora=self._no_lora(shape))
        if not self.token_counts or shape.num_tokens > self.token_counts[-1]:
            return None
        tokens = self.token_counts[bisect.bisect_left(self.token_counts, shape.num_tokens)]
        return GraphKey(tokens, self.mixed_rows(tokens), False, greedy, logits_only=True)

    def keys(self) -> list[GraphKey]:
        """Every key, in capture order: largest first within each kind (so later, smaller
        captures reuse the shared pool's memory), mixed before verify before decode (a
        speculative engine's mixed and decode graphs with the machinery before the plain ones)."""
        kinds = (True, False) if self.plain_steps else (self.speculative,)
        wide = [v for v in self.variants if v != SamplingVariant.NUCLEUS]  # decode graphs only
        mixed_variants = [v for v in wide if v == SamplingVariant.FULL] if self.collective else wide
        mixed = [GraphKey(t, self.mixed_rows(t), False, v, spec=k) for t in reversed(self.token_counts) for k in kinds
                 for v in mixed_variants]
        verify = [GraphKey(b * w, b, False, v, w, True) for w in reversed(self.verify_sizes)
                  for b in reversed(self.verify_sizes[w]) for v in wide]
        free = (False, True) if self.lora_free else (False,)
        decode = [GraphKey(b, b, True, v, spec=k, log_probs=lp, no_lora=nl) for b in reversed(self.decode_sizes)
                  for nl in free for k in kinds for v in self.variants for lp in self._twins(v)]
        if self.logits_only:  # steps with grammar rows
            greedy = SamplingVariant.GREEDY
            mixed += [GraphKey(t, self.mixed_rows(t), False, greedy, logits_only=True) for t in reversed(self.token_counts)]
            decode += [GraphKey(b, b, True, greedy, logits_only=True, no_lora=nl) for b in reversed(self.decode_sizes)
                       for nl in free]
        return mixed + verify + decode

    def _no_lora(self, shape) -> bool:
        """Whether a decode step replays a LoRA-free graph: no row has an adapter."""
        return self.lora_free and not shape.any_lora

    def _twins(self, variant: SamplingVariant) -> tuple[bool, ...]:
        """The ``GraphKey.log_probs`` values a decode graph of ``variant`` is planned with."""
        return (False, True) if self.log_prob_twins and variant != SamplingVariant.FULL else (False,)
