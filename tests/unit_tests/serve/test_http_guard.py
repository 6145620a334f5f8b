"""Every route behind the same guard (serve/http_guard.py), through the ASGI app in process: keys
per route class (API, admin with its own key, /health open, /metrics open unless asked), 401 as
OpenAI's error object without the key in it; bodies: Content-Encoding 415, a stalled body 408, a
client leaving mid-upload answered nothing and logged once at DEBUG; the admin routes as strict as
the API (deep nesting, media type, unknown fields, bad and escaping paths); CORS only when asked;
the refusal to start the admin endpoints on a reachable host without an admin key."""
import asyncio
import json
import logging
import os

import pytest

pytest.importorskip("fastapi")

from megatron_async.serve.app import create_app  # noqa: E402
from megatron_async.serve.http_guard import HttpPolicy, is_loopback, policy_from_args, refusal, route_class  # noqa: E402
from megatron_async.serve.server_state import ServerState  # noqa: E402

API, ADMIN = "sk-api-0123456789", "sk-admin-9876543210"


class FakeLoop:
    """The engine loop's interface, answering admin calls with what they were given."""

    def __init__(self):
        self.calls = []

    async def admin(self, op, args):
        self.calls.append((op, args))
        return 200, {"op": op}

    async def healthy(self):
        return True

    async def metrics_text(self):
        return b"# metrics\n"

    async def adapters(self):
        return []


def app_with(admin=True, max_request_bytes=2**20, **policy):
    state = ServerState(engine_loop=FakeLoop(), model_name="m", tokenizer=None, chat_template=None, max_model_len=64,
                        max_requests=4, max_request_bytes=max_request_bytes, admin_endpoints=admin,
                        policy=HttpPolicy(**policy))
    return create_app(state), state.engine_loop


async def call(app, method, path, body=b"", headers=(), messages=None, content_type=b"application/json"):
    """(status, headers, JSON body or raw bytes, whether anything was sent). ``messages``: the
    ASGI receive messages to play instead of one whole body (a ``("sleep", s)`` pauses)."""
    script = list(messages) if messages is not None else [{"type": "http.request", "body": body, "more_body": False}]
    out = {"status": None, "headers": [], "body": b""}

    async def receive():
        while script and isinstance(script[0], tuple):
            await asyncio.sleep(script.pop(0)[1])
        if script:
            return script.pop(0)
        await asyncio.sleep(3600)  # nothing more: the client waits

    async def send(m):
        if m["type"] == "http.response.start":
            out["status"], out["headers"] = m["status"], m["headers"]
        else:
            out["body"] += m.get("body", b"")

    hdrs = [(b"content-type", content_type)] if content_type else []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": hdrs + [(k.lower().encode(), v.encode()) for k, v in headers], "server": ("t", 80),
             "client": ("t", 1)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    try:
        parsed = json.loads(out["body"]) if out["body"] else None
    except ValueError:
        parsed = out["body"]
    return out["status"], dict(out["headers"]), parsed


def run(app, *args, **kw):
    return asyncio.run(call(app, *args, **kw))


def bearer(key):
    return [("Authorization", f"Bearer {key}")]


def test_route_classes():
    assert [route_class(p) for p in ("/health", "/metrics", "/v1/models", "/v1", "/tokenize", "/update_weights",
                                     "/nope")] == ["open", "metrics", "api", "api", "api", "admin", "admin"]
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.3.4.5")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("myhost")


def test_keys_per_route_class():
    app, loop = app_with(api_key=API, admin_api_key=ADMIN)
    status, headers, body = run(app, "GET", "/v1/models")
    assert status == 401 and body["error"]["code"] == 401 and body["error"]["type"] == "invalid_request_error"
    assert headers[b"www-authenticate"] == b"Bearer"
    for key in ("sk-guess-42", API + "x", API[:-1], ADMIN):
        status, _, body = run(app, "GET", "/v1/models", headers=bearer(key))
        assert status == 401 and key not in json.dumps(body), key
    assert run(app, "GET", "/v1/models", headers=[("Authorization", f"Basic {API}")])[0] == 401
    assert run(app, "GET", "/v1/models", headers=bearer(API))[0] == 200
    assert run(app, "GET", "/health")[0] == 200 and run(app, "GET", "/metrics")[0] == 200
    # the admin routes take the admin key, not the API key
    assert run(app, "POST", "/resume_generation", headers=bearer(API))[0] == 401
    assert run(app, "POST", "/resume_generation")[0] == 401
    assert run(app, "POST", "/resume_generation", headers=bearer(ADMIN))[0] == 200 and loop.calls == [
        ("resume_generation", {})]
    # an unknown path answers 401 before 404: nothing tells a stranger which routes exist
    assert run(app, "POST", "/nope")[0] == 401 and run(app, "POST", "/nope", headers=bearer(ADMIN))[0] == 404


def test_metrics_behind_the_key_and_admin_falling_back_to_the_api_key():
    app, _ = app_with(api_key=API, metrics_need_key=True)
    assert run(app, "GET", "/metrics")[0] == 401 and run(app, "GET", "/metrics", headers=bearer(API))[0] == 200
    assert run(app, "POST", "/resume_generation", headers=bearer(API))[0] == 200  # no admin key: the API key
    open_app, _ = app_with()
    assert run(open_app, "GET", "/v1/models")[0] == 200 and run(open_app, "POST", "/resume_generation")[0] == 200


def test_bodies_encoding_size_and_stalls(caplog):
    app, _ = app_with(body_timeout_s=0.3, max_request_bytes=4096)
    for encoding in ("gzip", "br", "deflate"):
        status, _, body = run(app, "POST", "/v1/completions", b'{"prompt": "x"}', [("Content-Encoding", encoding)])
        assert status == 415 and encoding in body["error"]["message"]
    assert run(app, "POST", "/v1/completions", b"{}", [("Content-Length", "5000")])[0] == 413
    big = [{"type": "http.request", "body": b"x" * 3000, "more_body": True}] * 2
    assert run(app, "POST", "/v1/completions", messages=big)[0] == 413  # chunked: refused as it passes the limit
    stalled = [{"type": "http.request", "body": b'{"pro', "more_body": True}, ("sleep", 1.0)]
    status, headers, body = run(app, "POST", "/v1/completions", messages=stalled)
    assert status == 408 and headers[b"connection"] == b"close" and body["error"]["code"] == 408
    with caplog.at_level(logging.DEBUG, logger="megatron_async.serve"):
        caplog.clear()
        left = [{"type": "http.request", "body": b'{"prompt": "x", ', "more_body": True}, {"type": "http.disconnect"}]
        for path in ("/v1/completions", "/update_weights"):
            assert run(app, "POST", path, messages=left)[0] is None  # nothing sent to a closed socket
    assert len(caplog.records) == 2 and {r.levelno for r in caplog.records} == {logging.DEBUG}
    assert not any(r.exc_info for r in caplog.records)


ADMIN_ROUTES = ["/pause_generation", "/resume_generation", "/update_weights", "/suspend", "/resume",
                "/init_weight_transfer", "/update_weights_from_ipc", "/destroy_weight_transfer", "/abort_requests"]


@pytest.mark.parametrize("path", ADMIN_ROUTES)
def test_admin_bodies_as_strict_as_the_api(path):
    app, loop = app_with()
    deep = b"[" * 100_000 + b"]" * 100_000
    status, _, body = run(app, "POST", path, b'{"x": ' + deep + b"}")
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    assert run(app, "POST", path, b'{"mode": "keep"}', content_type=b"text/plain")[0] == 415
    status, _, body = run(app, "POST", path, b'{"surprise": 1}')
    assert status == 400 and "unknown field" in body["error"]["message"] and "surprise" in body["error"]["message"]
    assert loop.calls == []


def test_weights_paths(tmp_path):
    allowed, outside = tmp_path / "ckpts", tmp_path / "elsewhere"
    (allowed / "v1").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, allowed / "link")
    app, loop = app_with(allowed_weights_dir=str(allowed))
    for path in (str(allowed / ".." / "elsewhere"), str(allowed / "link"), str(outside), "/etc"):
        status, _, body = run(app, "POST", "/update_weights", json.dumps({"path": path}).encode())
        assert status == 403 and body["error"]["code"] == 403, path
    for path in (str(allowed / ("x" * 300)), str(allowed) + "/a" * 3000, str(allowed / "missing"),
                 str(allowed / "v1" / "bad\u0000path")):
        status, _, body = run(app, "POST", "/update_weights", json.dumps({"path": path}).encode())
        assert status == 400, (path[:20], status, body)
    anywhere, _ = app_with()
    assert run(anywhere, "POST", "/update_weights", json.dumps({"path": "x" * 300}).encode())[0] == 400
    assert loop.calls == []
    assert run(app, "POST", "/update_weights", json.dumps({"path": str(allowed / "v1")}).encode())[0] == 200
    assert loop.calls == [("update_weights", {"path": str(allowed / "v1"), "version": None})]


def test_cors_only_when_asked():
    preflight = [("Origin", "https://app.example"), ("Access-Control-Request-Method", "POST"),
                 ("Access-Control-Request-Headers", "authorization,content-type")]
    plain, _ = app_with(api_key=API)
    status, headers, _ = run(plain, "OPTIONS", "/v1/completions", headers=preflight)
    assert b"access-control-allow-origin" not in headers
    app, _ = app_with(api_key=API, allowed_origins=("https://app.example",))
    status, headers, _ = run(app, "OPTIONS", "/v1/completions", headers=preflight)  # no key on a preflight
    assert status == 200 and headers[b"access-control-allow-origin"] == b"https://app.example"
    status, headers, _ = run(app, "GET", "/v1/models", headers=[("Origin", "https://app.example"), *bearer(API)])
    assert status == 200 and headers[b"access-control-allow-origin"] == b"https://app.example"
    status, headers, _ = run(app, "OPTIONS", "/v1/completions", headers=[("Origin", "https://evil.example"),
                                                                          *preflight[1:]])
    assert headers.get(b"access-control-allow-origin") != b"https://evil.example"


def test_refusal_to_start(monkeypatch, tmp_path):
    from megatron_async.serve.__main__ import build_parser

    def why(*flags, env=None):
        monkeypatch.delenv("MEGATRON_ASYNC_API_KEY", raising=False)
        if env:
            monkeypatch.setenv("MEGATRON_ASYNC_API_KEY", env)
        args = build_parser().parse_args(list(flags))
        return refusal(args, policy_from_args(args)), policy_from_args(args)

    reason, _ = why("--enable-admin-endpoints", "--host", "0.0.0.0")
    assert "needs --admin-api-key" in reason
    assert why("--enable-admin-endpoints", "--host", "0.0.0.0", "--api-key", API)[0] is not None
    assert why("--enable-admin-endpoints", "--host", "0.0.0.0", "--admin-api-key", ADMIN)[0] is None
    assert why("--enable-admin-endpoints")[0] is None  # loopback
    assert why("--host", "0.0.0.0")[0] is None  # no admin endpoints
    assert "go together" in why("--ssl-keyfile", __file__)[0]
    assert why(env=API)[1].api_key == API and why("--api-key", "k", env=API)[1].api_key == "k"
    assert API not in repr(why(env=API)[1])
    assert "not a directory" in why("--allowed-weights-dir", str(tmp_path / "none"))[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.helpers.hf_models import make_tiny_checkpoint

    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("guard") / "qwen3", seed=0)


@pytest.mark.parametrize("flags, limit", [((), 16), (("--max-prompts-per-body", "20"), 20)])
def test_prompts_per_body(ckpt, flags, limit):
    """One body asks for at most --max-prompts-per-body completions (prompts x n; default 4 x
    --max-requests): one more is a 400 naming the limit, before anything is tokenized or queued."""
    from tests.unit_tests.serve.test_admin_routes import _server

    llm, state, app = _server(ckpt, *flags)
    state.engine_loop.start()
    try:
        body = {"prompt": [[1, 2]] * (limit // 2), "n": 2, "max_tokens": 1}
        status, _, out = run(app, "POST", "/v1/completions", json.dumps(body).encode())
        assert status == 200 and len(out["choices"]) == limit
        for over in ({**body, "prompt": [[1, 2]] * (limit + 1), "n": 1}, {**body, "prompt": [[1, 2]] * (limit // 2 + 1)}):
            status, _, out = run(app, "POST", "/v1/completions", json.dumps(over).encode())
            assert status == 400 and out["error"]["param"] == "prompt", out
            assert f"at most {limit} per body" in out["error"]["message"]
        assert llm.engine.stats.rejected_requests == 0
    finally:
        state.engine_loop.stop()
