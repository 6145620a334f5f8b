"""Which CUDA graphs exist: the key of a step, and the full list warm-up captures.

Pure host logic (no CUDA), so CPU tests check that every step serving can produce maps to a
key warm-up captured. A key is (padded tokens, padded rows, decode-only, sampling variant).

Sampling variants: sampling_variants.py (a chain, each covering the ones before it, with log-prob
twins for decode graphs).

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
mixed forwards are the plan's largest captures; verify and data-parallel graphs keep LoRA.

Mixed graphs of at least ``long_tile_min`` tokens have long-tile twins (``GraphKey.long_tiles``: the
prefill attention on its long-row launch, ``triton_prefill_common.HOPPER_LONG``), replayed by steps
whose longest row has that many query tokens (``StepShape.long_tiles``, set by the host): a
graph's launch is fixed at capture and a mixed graph pads its rows, so the step's sizes cannot pick
the tiles inside it. Only buckets that can hold such a row get twins, never decode sizes; none for
data-parallel engines (one agreed key across ranks: they keep the default tiles)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from megatron_async.config import GraphSizing
from megatron_async.inference.text_generation_controllers.sampling_variants import (  # noqa: F401 (re-exported)
    GRAPH_TOP_N, SamplingVariant, VariantFlags, sampling_needs, variant_flags, variant_index, variant_of,
    variant_of_params,
)

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
    long_tiles: bool = False
    """A mixed graph whose prefill attention runs the long-row launch (``StepShape.long_tiles``)."""

    @property
    def label(self) -> str:
        """The sampling the graph runs: the variant's name, "+log_probs" for a twin."""
        if self.logits_only:
            return "logits" + "-lora" * self.no_lora + "+long" * self.long_tiles
        return self.variant.value + "+log_probs" * self.log_probs + "-lora" * self.no_lora + "+long" * self.long_tiles


def default_batch_sizes(max_requests: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_requests]
    sizes += list(range(16, max_requests + 1, 16))
    if sizes[-1] != max_requests:
        sizes.append(max_requests)
    return sizes


def decode_batch_sizes(config: GraphSizing) -> list[int]:
    """The row counts decode graphs are captured at: as configured, or ``default_batch_sizes``."""
    return sorted(config.cuda_graph_batch_sizes or default_batch_sizes(config.max_requests))


def splits_sampling(config: GraphSizing) -> bool:
    """Whether decode and mixed steps replay a forward graph and a sampling tail
    (``CudaGraphRunner.split_sampling``): plain engines, data-parallel ones too (their collectives
    are all in the forward, which every rank replays at the agreed size); speculative engines
    (the drafter reads the forward's hidden states) capture whole steps."""
    return config.num_speculative_tokens == 0


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
                 collective: bool = False, lora_free: bool = False, long_tile_min: int = 0):
        """``verify``: verify graphs for speculative decoding (``num_speculative_tokens`` > 0).
        ``plain_steps``: a speculative engine's decode and mixed steps may run plain (decode and
        mixed graphs of both kinds). ``log_prob_twins``: decode graphs of the variants below FULL have
        log-prob twins (off: every log-prob step replays FULL). ``logits_only``: logits-only
        graphs (the forwards of sampling tails; for steps with grammar rows too, but not with
        speculative decoding or in data-parallel engines). ``collective``:
        data-parallel engines, whose mixed graphs are ``collective_mixed_tokens``' sizes, FULL only.
        ``lora_free``: a LoRA engine whose steps without adapter rows skip the LoRA ops: its
        decode graphs have LoRA-free twins (not for data-parallel engines). ``long_tile_min``: mixed
        graphs of at least this many tokens have long-tile twins (0: none; not for data-parallel engines)."""
        self.collective = collective
        self.long_tile_min = 0 if collective else long_tile_min
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
        return GraphKey(tokens, self.mixed_rows(tokens), False, variant, spec=spec, long_tiles=self._long(shape))

    def _logits_key(self, shape, min_rows: int) -> GraphKey | None:
        """The logits-only graph of a step with grammar rows (None: eager; always for
        data-parallel engines, whose logits-only graphs are only their tails' forwards)."""
        if (not self.logits_only or self.collective or min_rows or shape.verify_width
                or shape.num_samples > shape.num_rows):
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
        return GraphKey(tokens, self.mixed_rows(tokens), False, greedy, logits_only=True, long_tiles=self._long(shape))

    def keys(self) -> list[GraphKey]:
        """Every key, in capture order: largest first within each kind (so later, smaller
        captures reuse the shared pool's memory), mixed before verify before decode (a
        speculative engine's mixed and decode graphs with the machinery before the plain ones)."""
        kinds = (True, False) if self.plain_steps else (self.speculative,)
        wide = [v for v in self.variants if v != SamplingVariant.NUCLEUS]  # decode graphs only
        mixed_variants = [v for v in wide if v == SamplingVariant.FULL] if self.collective else wide
        mixed = [GraphKey(t, self.mixed_rows(t), False, v, spec=k, long_tiles=lt) for t in reversed(self.token_counts)
                 for lt in self._tile_classes(t) for k in kinds for v in mixed_variants]
        verify = [GraphKey(b * w, b, False, v, w, True) for w in reversed(self.verify_sizes)
                  for b in reversed(self.verify_sizes[w]) for v in wide]
        free = (False, True) if self.lora_free else (False,)
        decode = [GraphKey(b, b, True, v, spec=k, log_probs=lp, no_lora=nl) for b in reversed(self.decode_sizes)
                  for nl in free for k in kinds for v in self.variants for lp in self._twins(v)]
        if self.logits_only:  # steps with grammar rows
            greedy = SamplingVariant.GREEDY
            mixed += [GraphKey(t, self.mixed_rows(t), False, greedy, logits_only=True, long_tiles=lt)
                      for t in reversed(self.token_counts) for lt in self._tile_classes(t)]
            decode += [GraphKey(b, b, True, greedy, logits_only=True, no_lora=nl) for b in reversed(self.decode_sizes)
                       for nl in free]
        return mixed + verify + decode

    def _tile_classes(self, tokens: int) -> tuple[bool, ...]:
        """The ``GraphKey.long_tiles`` values a mixed graph of ``tokens`` is planned with: a twin where
        a row of ``long_tile_min`` query tokens fits."""
        return (False, True) if self.long_tile_min and tokens >= self.long_tile_min else (False,)

    def _long(self, shape) -> bool:
        """Whether a mixed step replays a long-tile graph (the host chose the long-row launch)."""
        return bool(self.long_tile_min) and shape.long_tiles

    def _no_lora(self, shape) -> bool:
        """Whether a decode step replays a LoRA-free graph: no row has an adapter."""
        return self.lora_free and not shape.any_lora

    def _twins(self, variant: SamplingVariant) -> tuple[bool, ...]:
        """The ``GraphKey.log_probs`` values a decode graph of ``variant`` is planned with."""
        return (False, True) if self.log_prob_twins and variant != SamplingVariant.FULL else (False,)
