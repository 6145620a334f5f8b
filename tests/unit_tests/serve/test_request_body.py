"""Request bodies: the media type, the size limit (declared or counted while reading) and JSON
that Python cannot hold are each the right 4xx (BadRequest subclasses), never another exception."""
import asyncio

import pytest

pytest.importorskip("pydantic")

from megatron_async.serve.chat_routes import chat_template_kwargs  # noqa: E402
from megatron_async.serve.openai_protocol import (  # noqa: E402
    BadRequest, ChatCompletionRequest, PayloadTooLarge, UnsupportedMediaType,
)
from megatron_async.serve.request_input import (  # noqa: E402
    check_content_length, check_content_type, decode_json, parse_body, read_limited,
)


def test_content_type():
    for ok in ("application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json"):
        check_content_type(ok)
    for bad in (None, "", "text/plain", "application/x-www-form-urlencoded", "application/jsonx"):
        with pytest.raises(UnsupportedMediaType):
            check_content_type(bad)


def test_size_limit_declared_and_while_reading():
    check_content_length(None, 10)
    check_content_length("10", 10)
    with pytest.raises(PayloadTooLarge):
        check_content_length("11", 10)
    with pytest.raises(BadRequest):
        check_content_length("ten", 10)
    pulled = []

    async def chunks():  # a chunked body: no declared length, and more arrives than the limit
        for i in range(100):
            pulled.append(i)
            yield b"x" * 4

    assert asyncio.run(read_limited(chunks(), 400)) == b"x" * 400
    pulled.clear()
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_limited(chunks(), 10))
    assert len(pulled) == 3  # refused at the chunk that crossed the limit, the rest never read


@pytest.mark.parametrize("raw, reason", [
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"max_tokens": ' + b"1" * 5000 + b"}", "not valid JSON"),
    (b'{"x": "a\\ud800b"}', "surrogate"),
    (b'{"x": ["ok", {"k\\udfff": 1}]}', "surrogate"),
    (b'{"x": "\xff"}', "not UTF-8"),
    (b"{not json", "not valid JSON"),
])
def test_json_python_cannot_hold_is_a_bad_request(raw, reason):
    with pytest.raises(BadRequest, match=reason) as e:
        decode_json(raw)
    assert type(e.value) is BadRequest


def test_valid_surrogate_pairs_and_escapes_pass():
    assert decode_json(b'{"x": "\\ud83d\\ude00", "y": "\\\\ud800"}') == {"x": "\U0001F600", "y": "\\ud800"}


def test_chat_template_kwargs_override_add_generation_prompt_and_keep_reserved_names():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    req = parse_body(ChatCompletionRequest, {**base, "chat_template_kwargs": {"add_generation_prompt": False, "k": 1}})
    assert chat_template_kwargs(req) == (False, {"k": 1})
    assert chat_template_kwargs(parse_body(ChatCompletionRequest, base)) == (True, {})
    for kwargs in ({"add_generation_prompt": "no"}, {"messages": []}, {"self": 1}):
        with pytest.raises(BadRequest, match="chat_template_kwargs"):
            chat_template_kwargs(parse_body(ChatCompletionRequest, {**base, "chat_template_kwargs": kwargs}))
