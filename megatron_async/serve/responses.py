"""OpenAI response bodies: completions and chat, whole or as SSE chunks, with log-probs and the
``token_ids`` extra. Pure functions over engine outputs (no I/O)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from megatron_async.dp_engine.engine_ops import error_body  # noqa: F401 -- the bodies of every error
from megatron_async.inference.request import RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict | str | list[dict]) -> str:
    """One server-sent event (``data: [DONE]`` for the end marker); a list: one event per body."""
    if isinstance(data, list):
        return "".join(sse(d) for d in data)
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


TEXT_SLOT = "\x00text\x00"
TOKENS_SLOT = "\x00tokens\x00"
"""Placeholders for JsonTemplate's variable fields (their JSON forms, with escaped NULs, cannot
occur elsewhere in a body)."""


class JsonTemplate:
    """``json.dumps`` of a body whose few fields vary from chunk to chunk (a stream chunk's text,
    its token ids): the rest is encoded once, so each chunk costs the encoding of its variable
    values only. ``slots``: the placeholders the body holds, in the order ``__call__`` takes
    their values."""

    def __init__(self, body: dict, slots: tuple[str, ...] = (TEXT_SLOT,)):
        text = json.dumps(body, ensure_ascii=False)
        marks = sorted((text.index(json.dumps(s)), k, json.dumps(s)) for k, s in enumerate(slots))
        self._parts, self._order, at = [], [], 0
        for pos, k, mark in marks:
            self._parts.append(text[at:pos])
            self._order.append(k)
            at = pos + len(mark)
        self._parts.append(text[at:])

    def __call__(self, *values) -> str:
        out = [self._parts[0]]
        for part, k in zip(self._parts[1:], self._order):
            out.append(json.dumps(values[k], ensure_ascii=False))
            out.append(part)
        return "".join(out)


def chunk_template(body: dict) -> JsonTemplate:
    """A stream chunk built with ``TEXT_SLOT`` for its text and, with ``return_token_ids``,
    ``TOKENS_SLOT`` for its ids: called with the text, then the ids where the body holds them."""
    slots = (TEXT_SLOT, TOKENS_SLOT) if json.dumps(TOKENS_SLOT) in json.dumps(body) else (TEXT_SLOT,)
    return JsonTemplate(body, slots)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def with_usage(chunk: dict | str | list, counts: dict) -> dict | str | list:
    """A stream chunk (a body, its JSON text from a template, or a list of bodies) carrying
    ``usage`` = ``counts`` (``stream_options.continuous_usage_stats``)."""
    if isinstance(chunk, list):
        return [with_usage(c, counts) for c in chunk]
    if isinstance(chunk, str):  # a JSON object's text: the field goes in before its closing brace
        return f'{chunk[:-1]}, "usage": {json.dumps(counts)}}}'
    return {**chunk, "usage": counts}


@dataclass
class ResponseHead:
    """What every body and chunk of one HTTP request repeats."""

    object: str
    model: str
    id: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}


class TokenText:
    """Token id -> its text, for log-prob entries (cached: the same ids recur)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self._cache:
            self._cache[token] = self._tok.decode([token]) if self._tok is not None else f"<{token}>"
        return self._cache[token]


def completion_logprobs(tokens, log_probs, tops, text_of: TokenText, offset: int = 0) -> dict | None:
    """The legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs,
    text_offset) of some generated tokens; ``offset``: text length before them (a stream's
    earlier chunks), so that streamed chunks concatenate to the whole answer's object."""
    if log_probs is None:
        return None
    texts = [text_of(t) for t in tokens]
    offsets = []
    for s in texts:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": texts,
        "token_logprobs": list(log_probs),
        "top_logprobs": ([{text_of(t): lp for t, lp in top.items()} if top is not None else None for top in tops]
                         if tops is not None else None),
        "text_offset": offsets,
    }


def chat_logprobs(tokens, log_probs, tops, text_of: TokenText) -> dict | None:
    """The chat ``logprobs`` object: one entry per generated token with its top alternatives."""
    if log_probs is None:
        return None
    tops = tops if tops is not None else [{}] * len(tokens)

    def entry(token: int, lp: float) -> dict:
        s = text_of(token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [
        {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top.items()]}
        for t, lp, top in zip(tokens, log_probs, tops)
    ]}


def output_logprobs(out: RequestOutput) -> tuple:
    """(tokens, log-probs, top-n) of a whole answer, for the builders above."""
    return out.generated_tokens, out.generated_log_probs, out.generated_top_n_logprobs


def finish_reason(out: RequestOutput) -> str:
    return out.finish_reason


def completion_choice(index: int, out: RequestOutput, text_of: TokenText, token_ids: bool) -> dict:
    choice = {"index": index, "text": out.generated_text or "",
              "logprobs": completion_logprobs(*output_logprobs(out), text_of),
              "finish_reason": finish_reason(out)}
    if token_ids:
        choice["token_ids"] = list(out.generated_tokens)
        choice["prompt_token_ids"] = list(out.prompt_tokens)
    return choice


def chat_choice(index: int, out: RequestOutput, text_of: TokenText, token_ids: bool) -> dict:
    choice = {"index": index, "message": {"role": "assistant", "content": out.generated_text or ""},
              "logprobs": chat_logprobs(*output_logprobs(out), text_of), "finish_reason": finish_reason(out)}
    if token_ids:
        choice["token_ids"] = list(out.generated_tokens)
        choice["prompt_token_ids"] = list(out.prompt_tokens)
    return choice


def completion_chunk_choice(index: int, text: str, finish: str | None, tokens: list[int] | None,
                            logprobs: dict | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if tokens is not None:
        choice["token_ids"] = tokens
    return choice


def chat_chunk_choice(index: int, delta: dict, finish: str | None, tokens: list[int] | None,
                      logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    if tokens is not None:
        choice["token_ids"] = tokens
    return choice
