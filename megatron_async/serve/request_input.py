"""From an HTTP request to what the engine takes, every endpoint's first step: the body read and
decoded defensively, validated into its pydantic model (openai_protocol.py), the model name (the
served model or a LoRA adapter) and ``n`` checked, the chat template rendered and the prompts
tokenized.

The body: a JSON media type (else 415), at most ``max_request_bytes`` (else 413: refused from
Content-Length before reading, or as soon as the bytes read pass it), strict UTF-8, and JSON that
Python can hold: nesting too deep, integers over Python's digit limit and lone UTF-16 surrogates
(``"\\ud800"``, which no tokenizer or UTF-8 encoder takes) are each a 400 with the reason, never an
exception that escapes as a 500; then wrong types, unknown fields and unsupported options are a 400
naming the field. Work that grows with the input (decoding a big body, rendering the chat template,
tokenizing) runs on a thread pool, off the event loop, so that a huge prompt delays no other
request; a text prompt longer than any ``max_model_len`` tokens can hold is refused before it is
tokenized."""
from __future__ import annotations

import asyncio
import json
import re
import reprlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from pydantic import ValidationError

from megatron_async.models.chat_template import ChatTemplateError
from megatron_async.serve.openai_protocol import BadRequest, NotFound, PayloadTooLarge, UnsupportedMediaType
from megatron_async.serve.server_state import ServerState

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate; raw UTF-8 cannot encode one, so without this escape
the decoded body holds none and needs no walk."""


def check_content_type(content_type: str | None) -> None:
    """``application/json`` (any parameters, e.g. charset) or a ``+json`` type; anything else,
    missing included, is 415 as vLLM answers."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {content_type or 'none'!r}")


def check_content_length(content_length: str | None, limit: int) -> None:
    """Refuse a body whose declared size is over ``limit`` before reading a byte of it."""
    if content_length is None:
        return
    try:
        declared = int(content_length)
    except ValueError:
        raise BadRequest(f"Content-Length is not a number: {content_length[:40]!r}") from None
    if declared > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; this server takes at most {limit}")


async def read_limited(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The body's bytes, refused as soon as more than ``limit`` have arrived (a chunked body
    declares no length)."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over {limit} bytes, the most this server takes")
        parts.append(chunk)
    return b"".join(parts)


def decode_json(raw: bytes) -> Any:
    """The decoded body; every way it can fail is a BadRequest."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not UTF-8: {e}") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and an integer longer than Python's digit limit
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(body):
        raise BadRequest("request body has a lone UTF-16 surrogate (\\ud800-\\udfff) in a string: not valid Unicode")
    return body


def _has_lone_surrogate(value: Any) -> bool:
    """Walks without recursion (the body may be nested as deep as json.loads allows)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 2, 80, 80, 80
    return r


_brief = _short_repr().repr
"""A short repr of any decoded JSON value (deeply nested or huge ones included) for messages."""


def _is_union_branch(part: Any) -> bool:
    """pydantic names the union member it tried in an error's location ('str', 'list[int]', ...)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part or "-" in part)


def parse_body(model: type, body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_branch(p))
        raise BadRequest(f"{loc or 'body'}: {err['msg']} (got {_brief(err.get('input'))})", loc or None) from None


OFF_LOOP_BYTES = 64 * 2**10
"""Bodies, prompts and chat messages over this size are decoded, rendered and tokenized on the
thread pool; smaller ones inline (a thread hop costs more than their work)."""
MAX_COMPOSED_CHARS = 4
"""A tokenizer's normalizer (NFC / NFKC) may compose up to 3 characters into one before tokenizing."""


def max_token_chars(tokenizer) -> int:
    """The longest text one token of the vocabulary decodes to, in characters."""
    return max((len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size)), default=1)


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """More characters than this cannot tokenize into ``max_model_len`` tokens or fewer."""
    return max_model_len * max(1, max_token_chars(tokenizer)) * MAX_COMPOSED_CHARS


class RequestInput:
    def __init__(self, state: ServerState):
        self.state = state
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="megatron-async-input")
        self.prompt_chars = max_prompt_chars(state.tokenizer, state.max_model_len) if state.tokenizer is not None else 0
        """Text prompts longer than this are refused untokenized."""

    async def off_loop(self, big: bool, fn: Callable, *args):
        """``fn(*args)`` on the thread pool when its input is big, else right here."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args) if big else fn(*args)

    async def parse(self, request: Request, model: type):
        """The body as ``model``: content type, size, JSON and fields checked."""
        limit = self.state.max_request_bytes
        check_content_type(request.headers.get("content-type"))
        check_content_length(request.headers.get("content-length"), limit)
        raw = await read_limited(request.stream(), limit)
        return await self.off_loop(len(raw) > OFF_LOOP_BYTES, lambda: parse_body(model, decode_json(raw)))

    async def lora_of(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names: None for the served model (or no name),
        the adapter's name for a loaded adapter, else a 404 naming the ``model`` param. Where the engine's
        adapters are not known here (engines behind a coordinator) any other name goes to the
        engines as an adapter's, which refuse one they do not hold."""
        served = self.state.model_name
        if name is None or name == served:
            return None
        adapters = await self.state.engine_loop.adapters()
        if adapters is not None and name not in adapters:
            loaded = f" or one of its LoRA adapters {adapters}" if adapters else ""
            raise NotFound(f"model {name!r} does not exist; this server serves {served!r}{loaded}", "model")
        return name

    def check_n(self, n: int) -> None:
        if n > self.state.max_requests:
            raise BadRequest(f"n={n} is more than the {self.state.max_requests} requests this engine runs at once "
                                   "(--max-requests)", "n")

    def check_body_size(self, prompts: int, n: int) -> None:
        """One body may not hold more than ``prompts_per_body`` engine requests: nothing it asks for
        is queued without bound (a 400 naming the limit and its flag)."""
        limit = self.state.prompts_per_body
        if prompts * n > limit:
            raise BadRequest(f"this body asks for {prompts * n} completions ({prompts} prompts x n={n}); this "
                                   f"server takes at most {limit} per body (--max-prompts-per-body)", "prompt")

    async def render(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        """The chat template's prompt text for ``messages`` (on the thread pool when they are big)."""
        big = sum(len(m.get("content") or "") for m in messages) > OFF_LOOP_BYTES
        return await self.off_loop(big, self._render, messages, add_generation_prompt, kwargs)

    def _render(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            return self.state.chat_template.render(messages, add_generation_prompt, **kwargs)
        except ChatTemplateError as e:
            raise BadRequest(str(e), "messages") from None

    async def decode(self, tokens: list[int]) -> str:
        """The text of a prompt given as token ids ("" without a tokenizer)."""
        tokenizer = self.state.tokenizer
        if tokenizer is None:
            return ""
        return await self.off_loop(len(tokens) > OFF_LOOP_BYTES // 8, tokenizer.decode, tokens)

    async def tokens(self, prompts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each prompt; text longer than any prompt that fits is refused untokenized."""
        state = self.state
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and state.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        for t in texts:
            if len(t) > self.prompt_chars:
                raise BadRequest(f"the prompt is {len(t)} characters: more than {state.max_model_len} tokens "
                                       "(the most a request may hold) can cover", "prompt")

        def encode() -> list[list[int]]:
            return [state.tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str)
                    else list(p) for p in prompts]

        return await self.off_loop(sum(len(t) for t in texts) > OFF_LOOP_BYTES, encode)

