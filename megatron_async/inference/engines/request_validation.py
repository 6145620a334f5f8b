"""Checks that reject a request at ``add_request`` with a clear message, before it is queued."""
from __future__ import annotations

import math
import numbers

from megatron_async.config import InferenceConfig
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.request import InvalidRequestError, SamplingParams


class RequestValidator:
    def __init__(self, config: InferenceConfig, context: DynamicInferenceContext, vocab_size: int,
                 default_eos: int | None, tokenizer):
        self.config, self.context, self.vocab_size = config, context, vocab_size
        self.default_eos, self.tokenizer = default_eos, tokenizer

    def check(self, prompt, sp: SamplingParams) -> tuple[list[int], list[list[int]], int | None]:
        """-> (prompt token ids, stop sequences as token ids, termination id)."""
        if not isinstance(sp, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        sp.validate(self.vocab_size)
        check_sampling_extensions(sp)
        tokens = self._tokens(prompt)
        if not tokens:
            raise InvalidRequestError("empty prompt")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids outside the vocab [0, {self.vocab_size}): {bad[:5]}")
        total = len(tokens) + sp.num_tokens_to_generate
        if total > self.config.max_sequence_length:
            raise InvalidRequestError(
                f"prompt ({len(tokens)}) + num_tokens_to_generate ({sp.num_tokens_to_generate}) = {total} "
                f"exceeds max_sequence_length {self.config.max_sequence_length}"
            )
        if not self.context.can_ever_fit(total):
            raise InvalidRequestError(
                f"request needs {self.context.blocks_for(total)} KV blocks but the pool has only "
                f"{self.context.allocator.capacity}"
            )
        if not self.config.enable_chunked_prefill and len(tokens) > self.config.max_tokens:
            raise InvalidRequestError(
                f"prompt of {len(tokens)} tokens exceeds max_tokens {self.config.max_tokens} with chunked prefill off"
            )
        eos = sp.termination_id if sp.termination_id is not None else self.default_eos
        return tokens, self._stop_sequences(sp), eos

    def _tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids or a checkpoint with tokenizer.json")
            return self.tokenizer.encode(prompt)
        try:
            tokens = list(prompt)
        except TypeError:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}") from None
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be integers, got {bad[:5]}")
        return [int(t) for t in tokens]

    def _stop_sequences(self, sp: SamplingParams) -> list[list[int]]:
        out = []
        for w in sp.stop_words or []:
            if isinstance(w, str):
                if self.tokenizer is None:
                    raise InvalidRequestError("string stop_words need a tokenizer; give token-id lists instead")
                seq = self.tokenizer.encode(w)
            else:
                seq = [int(t) for t in w]
            if not seq:
                raise InvalidRequestError(f"stop word {w!r} is empty")
            out.append(seq)
        return out


# ---------------------------------------------------------------- vLLM-named sampling extensions
def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}")
    return float(value)


def check_sampling_extensions(sp: SamplingParams) -> None:
    """min_tokens, min_p and the penalties: types, finiteness and vLLM's ranges."""
    if isinstance(sp.min_tokens, bool) or not isinstance(sp.min_tokens, numbers.Integral):
        raise InvalidRequestError(f"min_tokens must be an int, got {type(sp.min_tokens).__name__} {sp.min_tokens!r}")
    limit = sp.num_tokens_to_generate
    if not 0 <= sp.min_tokens or (isinstance(limit, numbers.Integral) and sp.min_tokens > limit):
        raise InvalidRequestError(f"min_tokens must be in [0, num_tokens_to_generate={limit}], got {sp.min_tokens}")
    if not 0.0 <= _real("min_p", sp.min_p) <= 1.0:
        raise InvalidRequestError(f"min_p must be in [0, 1], got {sp.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= _real(name, getattr(sp, name)) <= 2.0:
            raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(sp, name)}")
    # vLLM asks only > 0; the bounds keep logits / penalty finite for any float32 logit
    if not 0.01 <= _real("repetition_penalty", sp.repetition_penalty) <= 100.0:
        raise InvalidRequestError(f"repetition_penalty must be in [0.01, 100], got {sp.repetition_penalty}")
