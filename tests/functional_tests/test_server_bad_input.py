"""The server (a real process on loopback) against hostile bodies: every answer is < 500 with
OpenAI's JSON error object where it is an error (400 bad input, 404 unknown model, 413 too large,
415 not JSON), for hand-picked bodies that once got a 500 and for random JSON (hypothesis) at both
endpoints, streaming or not; the server keeps answering."""
import http.client
import json
import time
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_async.serve import openai_protocol as proto  # noqa: E402
from megatron_async.serve.process import ServerProcess  # noqa: E402
from tests.helpers.chat_templates import save_chat_template  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

MAX_REQUEST_BYTES = 1_000_000
MAX_REQUESTS = 8
SERVER_FLAGS = ["--num-kv-blocks", "64", "--block-size", "16", "--max-requests", str(MAX_REQUESTS),
                "--max-sequence-length", "64", "--max-request-bytes", str(MAX_REQUEST_BYTES)]
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("served") / "tiny-chat",
                                with_tokenizer=True, vocab_size=512)
    save_chat_template(path)
    with ServerProcess(["--model", str(path), *SERVER_FLAGS]) as srv:
        srv.host_port = urlparse(srv.url).hostname, urlparse(srv.url).port
        yield srv


def send(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*server.host_port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def post(server, path: str, body, headers: dict = JSON) -> tuple[int, bytes]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: surrogates as \ud800
    return send(server, "POST", path, raw, headers)


def assert_error(status: int, raw: bytes, want: int | None = None) -> dict:
    assert 400 <= status < 500 and (want is None or status == want), (status, raw[:300])
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["code"] == status and (err["param"] is None or isinstance(err["param"], str))
    return err


def assert_answer(status: int, raw: bytes) -> None:
    """< 500, and a well-formed body: an error object, a whole answer, or SSE ending in [DONE]."""
    if status != 200:
        assert_error(status, raw)
        return
    if raw.startswith(b"data: "):
        events = [e for e in raw.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]", raw[-300:]
        for e in events[:-1]:
            chunk = json.loads(e[len("data: "):])
            assert "choices" in chunk or "error" in chunk
    else:
        assert isinstance(json.loads(raw)["choices"], list)


def still_serves(server) -> None:
    assert send(server, "GET", "/health")[0] == 200
    status, raw = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and len(json.loads(raw)["choices"]) == 1


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, want", [
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}, 200),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"add_generation_prompt": "yes"}}, 400),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": []}}, 400),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400),
    ("/v1/completions", {"prompt": "a\udfffb", "max_tokens": 2}, 400),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}", 400),
    ("/v1/completions", b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("/v1/completions", b'{"prompt": "hi", "stop": ' + b"[" * 900 + b"]" * 900 + b"}", 400),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404),
    ("/v1/chat/completions", {**CHAT, "model": "no-such-model"}, 404),
    ("/v1/completions", {"prompt": "hi", "n": MAX_REQUESTS + 1}, 400),
])
def test_bodies_that_once_got_a_500(server, path, body, want):
    status, raw = post(server, path, body)
    if want == 200:
        assert status == 200, raw
    else:
        assert_error(status, raw, want)
    still_serves(server)


def test_n_up_to_the_engine_capacity(server):
    status, raw = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": MAX_REQUESTS})
    assert status == 200 and len(json.loads(raw)["choices"]) == MAX_REQUESTS
    err = assert_error(*post(server, "/v1/completions", {"prompt": "hi", "n": MAX_REQUESTS + 1}), 400)
    assert err["param"] == "n" and str(MAX_REQUESTS) in err["message"]


def test_status_codes_of_the_transport(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        assert_error(*post(server, "/v1/completions", body, headers), 415)
    assert post(server, "/v1/completions", body, {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    # declared over the limit: refused before a byte of the body is read (none is sent)
    conn = http.client.HTTPConnection(*server.host_port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_REQUEST_BYTES + 1))
    conn.endheaders()
    r = conn.getresponse()
    assert_error(r.status, r.read(), 413)
    conn.close()
    assert_error(*post(server, "/v1/completions", b'{"prompt": "' + b"x" * MAX_REQUEST_BYTES + b'"}'), 413)
    assert_error(*send(server, "GET", "/v1/nothing"), 404)
    assert_error(*send(server, "GET", "/v1/completions"), 405)
    status, raw = send(server, "GET", "/v1/models")
    created = json.loads(raw)["data"][0]["created"]
    assert status == 200 and time.time() - 3600 < created <= time.time()  # the server's start
    still_serves(server)


# ------------------------------------------------------------------ random JSON (hypothesis)
def _json_values():
    leaves = (st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.integers(-3, 300)
              | st.floats(allow_nan=True, allow_infinity=True)
              | st.text(max_size=20)
              | st.sampled_from(["", "x" * 100_000, "\ud800", "hi\udc00", "<|endoftext|>"]))
    return st.recursive(leaves, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                          max_size=4), max_leaves=12)


def _bodies(model: type, base: dict):
    """A valid base body with some fields replaced by random JSON (wrong types, huge values),
    sometimes unknown fields, sometimes a raw body (deep nesting, huge integers, not JSON)."""
    fields = st.sampled_from(sorted(model.model_fields) + ["unknown_field"])
    mutated = st.builds(lambda changes, stream: json.dumps({**base, "stream": stream, **changes}).encode(),
                        st.dictionaries(fields, _json_values(), max_size=4), st.booleans())
    raw = st.one_of(
        st.integers(1, 200_000).map(lambda d: b'{"max_tokens": ' + b"[" * d + b"]" * d + b"}"),
        st.integers(4000, 6000).map(lambda d: b'{"max_tokens": ' + b"7" * d + b"}"),
        st.binary(max_size=64),
        _json_values().map(lambda v: json.dumps(v).encode()),
    )
    return st.one_of(mutated, mutated, mutated, raw)


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])


@FAST
@given(body=_bodies(proto.CompletionRequest, {"prompt": "hi", "max_tokens": 3}))
def test_random_completion_bodies_never_get_a_5xx(server, body):
    assert_answer(*post(server, "/v1/completions", body))


@FAST
@given(body=_bodies(proto.ChatCompletionRequest, CHAT))
def test_random_chat_bodies_never_get_a_5xx(server, body):
    assert_answer(*post(server, "/v1/chat/completions", body))


def test_the_server_serves_after_the_random_bodies(server):
    still_serves(server)
