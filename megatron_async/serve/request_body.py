"""An HTTP request's body, read and decoded defensively: a JSON media type (else 415), at most
``limit`` bytes (else 413: refused from Content-Length before reading, or as soon as the bytes read
pass it), strict UTF-8, and JSON that Python can hold: nesting too deep, integers over Python's
digit limit and lone UTF-16 surrogates (``"\\ud800"``, which no tokenizer or UTF-8 encoder takes)
are each a 400 with the reason, never an exception that escapes as a 500."""
from __future__ import annotations

import json
import re
from typing import Any, AsyncIterator

from megatron_async.serve.openai_protocol import BadRequest, PayloadTooLarge, UnsupportedMediaType

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
