"""Requests: a request's lifecycle status and scheduling state (``DynamicInferenceRequest``, owned
by the CPU context) and what the engine hands back (``RequestOutput``, ``RequestUpdate``). Its
sampling parameters and the error of a request that can never be served are sampling_params.py's,
importable from here as well (``megatron_async.inference.request.SamplingParams``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from megatron_async.inference.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["DynamicInferenceRequest", "FinishReason", "InvalidRequestError", "RequestOutput", "RequestUpdate",
           "SamplingParams", "Status"]

if TYPE_CHECKING:
    import numpy as np

    from megatron_async.inference.structured.request_grammar import BaseGrammar
    from megatron_async.inference.text_stream import TextStream


class Status(str, Enum):
    WAITING = "waiting"  # queued (new, or evicted and waiting to be recomputed)
    ACTIVE = "active"  # holds KV blocks; prefilling or decoding
    PAUSED = "paused"  # holds its KV blocks but has no block for its next token
    FINISHED = "finished"


class FinishReason(str, Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"  # engine.abort_request
    ERROR = "error"  # rejected at admission, or failed by a step that raised for it


@dataclass
class RequestOutput:
    request_id: int
    prompt_tokens: list[int]
    generated_tokens: list[int]
    generated_text: str | None
    finish_reason: str
    generated_log_probs: list[float] | None = None
    generated_top_n_logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    """Set (with finish_reason "error") when the request was rejected at admission or failed."""
    weight_versions: list[int] | None = None
    """One per generated token: the weight version (``LLM.update_weights``) that produced it."""
    prompt_log_probs: list[float] | None = None
    """``return_prompt_log_probs``: len(prompt) - 1 values, log P(prompt[i] | prompt[:i]) for i >= 1."""
    prompt_top_n_logprobs: list[dict[int, float]] | None = None
    """With ``top_n_logprobs`` > 0 too: one {token id: log-prob} per value of ``prompt_log_probs``."""
    routed_experts: np.ndarray | None = None
    """``return_routed_experts``: int16 [token, moe_layer, k], each token's top-k global expert
    ids, for every prompt token and every generated token but the last (routed_experts.py)."""


class RequestUpdate(NamedTuple):
    """What one request gained in one ``engine.step()`` (streaming). Immutable; a NamedTuple
    rather than a frozen dataclass because one is built per request per step (2.5x cheaper)."""

    request_id: int
    new_tokens: tuple[int, ...]
    new_text: str | None
    """Text that became stable with these tokens (None without a tokenizer or with
    ``InferenceConfig.stream_text`` off). The deltas of a request concatenate to its final
    ``generated_text``."""
    finished: bool
    finish_reason: str | None
    """Set when ``finished``; the full ``RequestOutput`` is in the same step's ``finished``."""
    new_log_probs: tuple[float, ...] | None = None
    """Log-probs of ``new_tokens`` (``return_log_probs``); they concatenate to the final
    ``generated_log_probs``."""
    new_top_n_logprobs: tuple[dict[int, float], ...] | None = None
    """One {token id: log-prob} per new token (``top_n_logprobs`` > 0)."""
    prompt_log_probs: tuple[float, ...] | None = None
    """``return_prompt_log_probs``: the whole prompt's log-probs, in the request's first update
    that has tokens or finishes it (the prefill has landed them all by then), else None."""
    prompt_top_n_logprobs: tuple[dict[int, float], ...] | None = None
    """With ``prompt_log_probs`` and ``top_n_logprobs`` > 0: one {token id: log-prob} per entry."""


_new_tuple = tuple.__new__  # take_update builds a RequestUpdate without its __new__'s Python frame
assert len(RequestUpdate._fields) == 9, "take_update gives every RequestUpdate field"


@dataclass
class DynamicInferenceRequest:
    """A request and its scheduling state; owned by the CPU context."""

    request_id: int
    prompt_tokens: list[int]
    sampling_params: SamplingParams
    seed: int
    eos_ids: frozenset[int] = frozenset()
    """Token ids that end the request (unless ``ignore_eos``)."""
    stop_sequences: list[list[int]] = field(default_factory=list)
    arrival_order: int = 0
    banned_ids: tuple[int, ...] = ()
    """Token ids it never samples (``bad_words``, tokenized at admission)."""
    banned_sequences: tuple[tuple[int, ...], ...] = ()
    """``bad_words`` of several tokens (contexts/sampling_state.py)."""

    status: Status = Status.WAITING
    generated_tokens: list[int] = field(default_factory=list)
    generated_log_probs: list[float] = field(default_factory=list)
    generated_top_n_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_log_probs: list[float] = field(default_factory=list)
    """Entry p: log P(prompt[p + 1] | prompt[:p + 1]), landed chunk by chunk (prompt_log_probs.py)."""
    prompt_top_n_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: TextStream | None = None
    """Incremental detokenizer + string stop words (None without a tokenizer)."""
    num_streamed_tokens: int = 0
    """Generated tokens already reported in a RequestUpdate."""
    weight_version_runs: list[tuple[int, int]] = field(default_factory=list)
    """(first generated index, weight version) at each change of version: run-length, so landing
    a token costs one comparison (``weight_versions`` expands it)."""
    routed_experts: np.ndarray | None = None
    """Routing replay: int16 [position, moe_layer, k] as landed, -1 where none yet (routed_experts.py)."""
    weights_epoch: int = -1
    """The context's weights epoch when the request was last admitted (-1: never admitted): its
    KV holds those weights' values, so it publishes prefix blocks only while they are current."""

    max_generated_tokens: int = 0
    """The length limit (stop_conditions.generation_limit), set when the request is queued."""

    # -- scheduling state (CPU truth) --
    num_computed_tokens: int = 0
    """Positions whose KV is computed or enqueued (in flight included)."""
    num_inflight: int = 0
    """Launched steps that sample for this request, not yet bookkept (0 or 1)."""
    num_inflight_drafts: int = 0
    """Drafts verified by that launch: it brings 1 to 1 + this many tokens (speculative decoding)."""
    inflight_row: int = -1
    """Row of this request in the latest launch when it samples there (input of the next decode)."""
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    last_block_hash: object | None = None
    """BlockKey of the last hashed block (kv_block_allocator)."""
    mamba_store_points: list[int] = field(default_factory=list)
    """Hybrid prefix caching: prefill chunks end at these positions so their states get cached."""
    state_slot: int = -1
    """Hybrid models: index of this request's live Mamba state slot (-1 = none)."""
    sampling_slot: int = -1
    """Row of this request's device token counts (penalties / min_tokens; -1 = none)."""
    spec_slot: int = -1
    """Speculative decoding: row of this request's device draft state (-1 = none)."""
    plain_stop_ids: frozenset[int] | None = None
    """When queued, if its only stops are token ids and the length limit (no stop sequences, text
    fed token by token or ``min_tokens``): those ids, checked inline (else None: ``finish_reason``)."""
    decode_slot: int = -1
    """Its row in the decode-only snapshot path's per-request arrays (contexts/decode_rows.py; -1 = none)."""
    spec_acceptance: float = 1.0
    """Moving average of its drafts' acceptance over its verify rows (host, bookkept): accepted /
    drafted, or per position in the adaptive speculative policy (speculative/policy.py)."""
    spec_positions: float = 0.0
    """Adaptive speculative policy: draft positions behind ``spec_acceptance`` (decayed; 0: no
    evidence of its own yet, speculative/step_choice.py)."""
    grammar: BaseGrammar | None = None
    """``structured_outputs``: the grammar state of the generated tokens (engines/grammar_masks.py)."""
    share_key: tuple[bytes, bytes] | None = None
    """(block hash key, digest of its last shareable prompt block) (contexts/prompt_sharing.py)."""
    prompt_digests: tuple[bytes, list[bytes]] | None = None
    """(block hash key, its prompt's leading block digests) as the rank that routed it or prompt
    sharing's key hashed them: the prefix match and publishing read them instead of hashing again."""
    queued_after: int = 0
    """Requests the scheduler had admitted when this one was queued (``SamplingParams.priority``)."""
    waited_for_prompt: bool = False
    """It waits for another request prefilling the same prompt (contexts/prompt_sharing.py)."""
    lora_slot: int = -1
    """Its adapter's slot while active (-1: the base model); ``lora_key``: that adapter's prefix-cache key."""
    lora_key: bytes = b""
    spec_drafts_fresh: bool = False
    """Its latest launched row ran the drafter, so its spec slot holds drafts for its next row
    (a plain step of a speculative engine leaves them stale; speculative/plain_steps.py)."""

    def __post_init__(self):
        if self.text is not None:  # the text reads the generated tokens itself (unless it watches stop strings)
            self.text.follow(self.generated_tokens)

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.generated_tokens)

    def token_at(self, position: int) -> int:
        n = len(self.prompt_tokens)
        return self.prompt_tokens[position] if position < n else self.generated_tokens[position - n]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Known tokens at positions [start, end)."""
        n = len(self.prompt_tokens)
        if end <= n:
            return self.prompt_tokens[start:end]
        if start >= n:
            return self.generated_tokens[start - n : end - n]
        return self.prompt_tokens[start:] + self.generated_tokens[: end - n]

    @property
    def max_prefix_hit(self) -> int:
        """Positions a prefix-cache hit may skip: none under routing replay (a skipped position's
        routing is never computed); a request scoring its prompt skips only those whose
        log-probs it already holds (a fresh one recomputes its whole prompt), so its prompt
        log-probs never have a hole."""
        if self.sampling_params.return_routed_experts:
            return 0
        scored = len(self.prompt_log_probs)
        if self.sampling_params.return_prompt_log_probs and scored < len(self.prompt_tokens) - 1:
            return scored
        return self.num_known_tokens

    @property
    def is_prefilling(self) -> bool:
        """Known tokens remain whose KV is not computed (prompt, or recompute after eviction)."""
        return self.num_computed_tokens < self.num_known_tokens

    @property
    def tokens_budgeted(self) -> int:
        """Generated tokens including those in flight, counting every in-flight draft as
        accepted (an upper bound: the most tokens the request may own when they land)."""
        return len(self.generated_tokens) + self.num_inflight + self.num_inflight_drafts

    @property
    def tokens_certain(self) -> int:
        """Generated tokens plus the one every in-flight launch surely brings (a lower bound)."""
        return len(self.generated_tokens) + self.num_inflight

    def take_update(self, with_text: bool = True) -> RequestUpdate:
        """Tokens (and text) gained since the last update (all that is left once finished)."""
        start, gen = self.num_streamed_tokens, self.generated_tokens
        new = (gen[start],) if len(gen) - start == 1 else tuple(gen[start:])  # most updates: one token
        self.num_streamed_tokens = len(gen)
        finished = self.status == Status.FINISHED
        text = self.text.take_delta() if self.text is not None and with_text else None
        reason = self.finish_reason.value if finished and self.finish_reason else None
        sp = self.sampling_params
        lps = tuple(self.generated_log_probs[start:]) if sp.return_log_probs else None
        tops = tuple(self.generated_top_n_logprobs[start:]) if sp.top_n_logprobs > 0 else None
        if start == 0 and sp.return_prompt_log_probs and (new or finished):
            return RequestUpdate(self.request_id, new, text, finished, reason, lps, tops, tuple(self.prompt_log_probs),
                                 tuple(self.prompt_top_n_logprobs) if sp.top_n_logprobs > 0 else None)
        return _new_tuple(RequestUpdate, (self.request_id, new, text, finished, reason, lps, tops, None, None))

    def to_output(self) -> RequestOutput:
        from megatron_async.inference.routed_experts import routed_experts_of  # torch: not for the server's front-ends

        sp = self.sampling_params
        return RequestOutput(
            request_id=self.request_id,
            prompt_tokens=list(self.prompt_tokens),
            generated_tokens=list(self.generated_tokens),
            generated_text=self.text.text if self.text is not None else None,
            finish_reason=self.finish_reason.value if self.finish_reason else "length",
            generated_log_probs=list(self.generated_log_probs) if sp.return_log_probs else None,
            generated_top_n_logprobs=list(self.generated_top_n_logprobs) if sp.top_n_logprobs > 0 else None,
            error=self.error,
            weight_versions=self.weight_versions(),
            prompt_log_probs=list(self.prompt_log_probs) if sp.return_prompt_log_probs else None,
            prompt_top_n_logprobs=(list(self.prompt_top_n_logprobs)
                                   if sp.return_prompt_log_probs and sp.top_n_logprobs > 0 else None),
            routed_experts=routed_experts_of(self),
        )

    def weight_versions(self) -> list[int]:
        """The weight version of each generated token, expanded from ``weight_version_runs``."""
        runs, out = self.weight_version_runs, []
        for i, (start, version) in enumerate(runs):
            end = runs[i + 1][0] if i + 1 < len(runs) else len(self.generated_tokens)
            out += [version] * (end - start)
        return out
