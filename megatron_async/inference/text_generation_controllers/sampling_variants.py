"""The sampling variants of CUDA graphs (graph_plan.py keys them).

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
of the step), and so do data-parallel engines' steps (the ranks agree on one chain index)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

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
