"""The speculative-decoding fields of ``InferenceConfig``: how many drafts a decode row verifies,
where they come from, and when a request or a step drafts at all. ``InferenceConfig.speculation()``
hands them to the drafter and the speculative policy."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_async.config.modes import SpeculativeMethod


@dataclass
class SpeculativeFields:
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
