"""Checks that reject a request at ``add_request`` with a clear message, before it is queued.

Types are checked from the annotations of ``SamplingParams`` (so every field, including ones
added later, is covered): a bool is not an int, 2.5 is not an int, a float must be finite,
and numpy scalars are accepted and converted. The request then holds a frozen, normalized
copy of the parameters."""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from dataclasses import dataclass

import numpy as np

from megatron_async.config import Scheduling
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.contexts.sampling_state import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from megatron_async.inference.engines.grammar_masks import GrammarMasks
from megatron_async.inference.engines.lora_control import check_request_adapter
from megatron_async.inference.request import InvalidRequestError, SamplingParams


@dataclass(frozen=True)
class ValidRequest:
    prompt_tokens: list[int]
    sampling_params: SamplingParams
    """Frozen, normalized copy (top_k clamped to the vocab size)."""
    stop_sequences: list[list[int]]
    stop_strings: list[str]
    eos_ids: frozenset[int]
    banned_ids: tuple[int, ...] = ()
    """``bad_words`` of one token, as the token ids they are."""
    banned_sequences: tuple[tuple[int, ...], ...] = ()
    """``bad_words`` of several tokens, as their token ids."""


_MISMATCH = object()


def _normalize(value, tp):
    """``value`` converted to annotation ``tp`` (tuples for lists), or _MISMATCH."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            out = _normalize(value, arg)
            if out is not _MISMATCH:
                return out
        return _MISMATCH
    if tp is type(None):
        return None if value is None else _MISMATCH
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return _MISMATCH
        (item,) = typing.get_args(tp)
        out = [_normalize(v, item) for v in value]
        return _MISMATCH if any(o is _MISMATCH for o in out) else tuple(out)
    if tp is bool:
        return bool(value) if isinstance(value, (bool, np.bool_)) else _MISMATCH
    if isinstance(value, (bool, np.bool_)):
        return _MISMATCH  # True is not 1
    if tp is int:
        return int(value) if isinstance(value, numbers.Integral) else _MISMATCH
    if tp is float:
        ok = isinstance(value, numbers.Real) and math.isfinite(value)
        return float(value) if ok else _MISMATCH
    if tp is str:
        return value if isinstance(value, str) else _MISMATCH
    # Any other annotation (a class, or a generic such as dict[int, float]): its container type.
    kind = origin if origin is not None else tp
    return value if isinstance(kind, type) and isinstance(value, kind) else _MISMATCH


def _describe(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is list:
        return f"a list of ({_describe(typing.get_args(tp)[0])})"
    return {float: "a finite number", int: "an integer", bool: "a bool", str: "a string"}.get(tp, str(tp))


@functools.cache
def _field_types() -> dict[str, object]:
    return typing.get_type_hints(SamplingParams)


@functools.cache
def _exact_types() -> dict[str, frozenset]:
    """Per field, the plain value types its annotation accepts unconverted (int, float, bool,
    str, None): such a value skips ``_normalize`` (typing introspection and ABC checks that
    cost ~0.1 ms per request)."""
    plain = {int, float, bool, str, type(None)}
    out = {}
    for f in dataclasses.fields(SamplingParams):
        tp = _field_types()[f.name]
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        out[f.name] = frozenset(a for a in args if a in plain)
    return out


def normalized_params(sp: SamplingParams) -> dict:
    """Every field checked against its annotation; returns the converted values."""
    out = {}
    for name, exact in _exact_types().items():
        value = getattr(sp, name)
        kind = type(value)
        if kind in exact and (kind is not float or math.isfinite(value)):
            out[name] = value
            continue
        tp = _field_types()[name]
        got = _normalize(value, tp)
        if got is _MISMATCH:
            raise InvalidRequestError(f"SamplingParams.{name} must be {_describe(tp)}, got {value!r}")
        out[name] = got
    return out


class RequestValidator:
    def __init__(self, config: Scheduling, context: DynamicInferenceContext, vocab_size: int,
                 eos_ids: tuple[int, ...], tokenizer, routes_experts: bool = False, grammars: GrammarMasks | None = None):
        """``routes_experts``: the model has MoE layers (``return_routed_experts`` is valid);
        ``grammars``: checks and builds structured outputs (None: they are refused)."""
        self.config, self.context, self.vocab_size = config, context, vocab_size
        self.routes_experts = routes_experts
        self.grammars = grammars
        self.eos_ids, self.tokenizer = frozenset(eos_ids), tokenizer

    def check(self, prompt, sp: SamplingParams) -> ValidRequest:
        """Raises InvalidRequestError, and nothing else, for a request that cannot be served."""
        try:
            return self._check(prompt, sp)
        except InvalidRequestError:
            raise
        except Exception as e:  # a check that itself broke on odd input: still the request's fault
            raise InvalidRequestError(f"invalid request: {type(e).__name__}: {e}") from e

    def _check(self, prompt, sp: SamplingParams) -> ValidRequest:
        if not isinstance(sp, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        values = normalized_params(sp)
        stop_words = values["stop_words"]
        if isinstance(stop_words, str):
            stop_words = (stop_words,)
        values["stop_words"] = stop_words
        values["top_k"] = min(values["top_k"], self.vocab_size)  # more than the vocab = all of it
        if values["logit_bias"] is not None:  # a copy: the caller's dict may change later
            values["logit_bias"] = dict(values["logit_bias"])
        frozen = sp.frozen_copy(**values)
        frozen.validate(self.vocab_size)
        check_sampling_extensions(frozen)
        if frozen.return_routed_experts and not self.routes_experts:
            raise InvalidRequestError("return_routed_experts needs a mixture-of-experts model; this one has no MoE layer")
        check_request_adapter(frozen.lora, self.context.lora)
        banned, banned_sequences = check_token_choices(frozen, self.vocab_size, self.tokenizer)
        if frozen.structured_outputs is not None:
            if self.grammars is None:
                raise InvalidRequestError("structured outputs are not served by this engine")
            self.grammars.check(frozen)
        tokens = self._tokens(prompt)
        if not tokens:
            raise InvalidRequestError("empty prompt")
        if not 0 <= min(tokens) <= max(tokens) < self.vocab_size:
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            raise InvalidRequestError(f"prompt token ids outside the vocab [0, {self.vocab_size}): {bad[:5]}")
        self._check_length(tokens, frozen)
        sequences, strings = self._stop_words(stop_words or ())
        eos = frozenset([frozen.termination_id]) if frozen.termination_id is not None else self.eos_ids
        return ValidRequest(tokens, frozen, sequences, strings, eos, banned, banned_sequences)

    def _check_length(self, tokens: list[int], sp: SamplingParams) -> None:
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

    def _tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids or a checkpoint with tokenizer.json")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) and not hasattr(prompt, "__array__"):
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype.kind in "iu":
            return prompt.tolist()
        tokens = list(prompt)
        if {type(t) for t in tokens} <= {int}:  # the common case: exact ints, no per-token ABC checks
            return tokens
        bad = [t for t in tokens if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral)]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be integers, got {bad[:5]}")
        return [int(t) for t in tokens]

    def _stop_words(self, words) -> tuple[list[list[int]], list[str]]:
        """-> (token-id stop sequences, stop strings)."""
        sequences, strings = [], []
        for w in words:
            if not w:
                raise InvalidRequestError(f"stop word {w!r} is empty")
            if isinstance(w, str):
                if self.tokenizer is None:
                    raise InvalidRequestError("string stop_words need a tokenizer; give token-id lists instead")
                strings.append(w)
                continue
            bad = [t for t in w if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"stop word {list(w)} has token ids outside the vocab [0, {self.vocab_size})")
            sequences.append(list(w))
        return sequences, strings


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


MAX_LOGIT_BIAS = 300
"""Entries of ``logit_bias`` a request may give (OpenAI's limit)."""


def check_token_choices(sp: SamplingParams, vocab_size: int, tokenizer
                        ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """``logit_bias``, ``allowed_token_ids`` and ``bad_words``: ids in the vocabulary, biases in
    [-100, 100]; returns what ``bad_words`` bans (each word with and without a leading space): the
    ids of one-token spellings, and the spellings of several tokens (at most ``MAX_BAD_WORDS`` of
    up to ``MAX_BAD_WORD_TOKENS`` tokens)."""
    def check_ids(name: str, ids) -> None:
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < vocab_size]
        if bad:
            raise InvalidRequestError(f"{name}: token ids outside the vocab [0, {vocab_size}): {bad[:5]}")

    if sp.logit_bias is not None:
        if len(sp.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias has {len(sp.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        check_ids("logit_bias", sp.logit_bias)
        for t, v in sp.logit_bias.items():
            if not -100.0 <= _real(f"logit_bias[{t}]", v) <= 100.0:
                raise InvalidRequestError(f"logit_bias[{t}] must be in [-100, 100], got {v}")
    if sp.allowed_token_ids is not None:
        if not sp.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids must not be empty")
        check_ids("allowed_token_ids", sp.allowed_token_ids)
    if not sp.bad_words:
        return (), ()
    if tokenizer is None:
        raise InvalidRequestError("bad_words need a tokenizer")
    banned, sequences = set(), {}
    for word in sp.bad_words:
        for spelling in dict.fromkeys((word, " " + word.lstrip())):
            ids = tokenizer.encode(spelling, add_special_tokens=False)
            if not ids or len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidRequestError(f"bad_words: {spelling!r} is {len(ids)} tokens; a word may have 1 to "
                                          f"{MAX_BAD_WORD_TOKENS}")
            if len(ids) == 1:
                banned.add(ids[0])
            else:
                sequences[tuple(ids)] = None
    if len(sequences) > MAX_BAD_WORDS:
        raise InvalidRequestError(f"bad_words: {len(sequences)} spellings of several tokens; at most {MAX_BAD_WORDS}")
    return tuple(sorted(banned)), tuple(sequences)
