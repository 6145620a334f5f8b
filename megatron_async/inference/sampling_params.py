"""A request's sampling parameters (``SamplingParams``: their fields, admission-time validation
and frozen copy), the sampling work they ask of a row (the feature bits of
``SamplingParams.features``), and the error of a request that can never be served."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_async.inference.structured.spec import StructuredOutputs

# What sampling work a row needs (``SamplingParams.features``); a step needs the OR over its
# sampling rows (StepShape flags, the CUDA-graph sampling variant). GRAMMAR: a token mask from
# the host (the step's sampling waits for it).
SAMPLED, TOP_K, TOP_P, MIN_P, LOG_PROBS, PENALTIES, GRAMMAR = (1 << i for i in range(7))


class InvalidRequestError(ValueError):
    """A request that can never be served (bad prompt, bad sampling params, too long, too big)."""


@dataclass
class SamplingParams:
    """Megatron-style sampling parameters. Greedy: ``top_k=1`` or ``temperature=0``.

    The engine validates a copy at ``add_request`` (every field's type from its annotation:
    a bool is not an int, 2.5 is not an int, floats must be finite) and freezes it, so
    changing the caller's object afterwards changes nothing."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off; values above the vocab size are clamped to it at admission
    top_p: float = 0.0  # 0 = off
    num_tokens_to_generate: int = 16
    termination_id: int | None = None  # None = every EOS id of the tokenizer / checkpoint
    ignore_eos: bool = False
    seed: int | None = None  # None = drawn from the engine's seeded generator at add_request
    return_log_probs: bool = False
    top_n_logprobs: int = 0
    return_prompt_log_probs: bool = False
    """Score the prompt: ``RequestOutput.prompt_log_probs`` (and ``prompt_top_n_logprobs`` with
    ``top_n_logprobs`` > 0). With it ``num_tokens_to_generate`` may be 0 (scoring only)."""
    stop_words: str | list[str | list[int]] | None = None
    """Strings match the decoded text (also across token boundaries); lists of ids match
    the generated ids. A single string is one stop word."""
    skip_special_tokens: bool = True
    """Leave special tokens (EOS among them) out of the generated text (vLLM meaning)."""
    include_stop_str_in_output: bool = False
    """Keep a matched stop string at the end of the generated text (vLLM meaning)."""

    # -- vLLM-named sampling extensions (checked by request_validation.check_sampling_extensions) --
    min_tokens: int = 0
    """EOS and single-token stop ids are masked (and stop checks skipped) until this many tokens were generated."""
    min_p: float = 0.0
    """Keep tokens whose probability is >= min_p x the top token's (after temperature); 0 = off."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that occurs in the output so far."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output so far."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or output: positive logits divided by it, negative multiplied; 1 = off."""
    return_routed_experts: bool = False
    """MoE models: ``RequestOutput.routed_experts`` (routing replay; the request skips prefix-cache hits)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a value in [-100, 100] added to its logit after the penalties (+100 all but forces
    a token, -100 bans it in practice); at most 300 entries, as OpenAI."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled (vLLM meaning)."""
    bad_words: list[str] | None = None
    """Words never generated, with and without a leading space (both spellings are banned): a
    one-token spelling is never sampled; the last token of a longer one (up to 8 tokens, 16 such
    spellings) is not sampled right after its other tokens were generated (vLLM's rule)."""
    priority: int = 0
    """Scheduling class: waiting requests of a lower class are admitted first (FIFO within one); a
    request moves up one class per ``InferenceConfig.priority_aging`` admissions while it waits."""
    lora: str | None = None
    """The LoRA adapter (a name given to ``LLM.load_lora``) that serves the request; None: the base model."""
    structured_outputs: StructuredOutputs | None = None
    """What the generated text must match (a JSON schema, any JSON object, a regex, a choice, a
    grammar): every sampled token is one the grammar allows, and the request ends with "stop" when
    the grammar is complete. Not with ``ignore_eos`` or ``min_tokens`` (they keep the end away)."""

    @property
    def has_penalties(self) -> bool:
        """Needs per-request token counts on the device (penalties or min_tokens)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0)

    @property
    def needs_sampling_slot(self) -> bool:
        """Needs a row of device sampling state (sampling_state.py): penalties, min_tokens, a
        logit bias or token bans."""
        return self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def is_greedy(self) -> bool:
        # Below ~1e-5, logits / temperature overflows float32; such a request is greedy anyway.
        return self.temperature < 1e-5 or self.top_k == 1  # same bound as sampling.GREEDY_TEMPERATURE

    def row_filters(self) -> tuple[float, int, float, float]:
        """(temperature, top_k, top_p, min_p) as a sampling row holds them: a greedy request's
        row is (0, 1, 0, 0) whatever it asked for. The one rule both snapshot builders follow."""
        if self.is_greedy:
            return 0.0, 1, 0.0, 0.0
        return float(self.temperature), self.top_k, self.top_p, self.min_p

    def features(self) -> int:
        """The sampling work a row of this request needs, as bits (SAMPLED, TOP_K, TOP_P, MIN_P,
        LOG_PROBS, PENALTIES, GRAMMAR): a greedy row draws nothing and filters nothing. The one rule the
        snapshot builders and the graph plan follow."""
        bits = (LOG_PROBS * bool(self.return_log_probs) | PENALTIES * self.needs_sampling_slot
                | GRAMMAR * (self.structured_outputs is not None))
        if self.is_greedy:
            return bits
        return (bits | SAMPLED | TOP_K * (self.top_k > 1) | TOP_P * (0 < self.top_p < 1)
                | MIN_P * (self.min_p > 0))

    def validate(self, vocab_size: int) -> None:
        """Range checks (types are checked before, in request_validation.check_types)."""
        if not self.temperature >= 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in [0, 1], got {self.top_p}")
        least = 0 if self.return_prompt_log_probs else 1  # 0: score the prompt only
        if self.num_tokens_to_generate < least:
            raise InvalidRequestError(f"num_tokens_to_generate must be >= {least}, got {self.num_tokens_to_generate}")
        if self.top_n_logprobs < 0 or self.top_n_logprobs > vocab_size:
            raise InvalidRequestError(f"top_n_logprobs must be in [0, {vocab_size}], got {self.top_n_logprobs}")
        if not -(2**31) <= self.priority < 2**31:
            raise InvalidRequestError(f"priority must be in [-2**31, 2**31), got {self.priority}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.termination_id is not None and not 0 <= self.termination_id < vocab_size:
            raise InvalidRequestError(f"termination_id {self.termination_id} outside vocab [0, {vocab_size})")

    def frozen_copy(self, **changes) -> SamplingParams:
        """A copy that raises on assignment (what an admitted request holds)."""
        copy = dataclasses.replace(self, **changes)
        object.__setattr__(copy, "_frozen", True)
        return copy

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign SamplingParams.{name}: an admitted request's parameters are frozen")
        object.__setattr__(self, name, value)
