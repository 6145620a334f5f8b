"""What ``python -m benchmarks server-hostile`` sends: random request bodies for every route
(fields of a valid body replaced by random JSON, unknown fields, raw bytes, deep nesting, huge
integers) and raw HTTP cases written straight to a socket (broken request lines and headers,
malformed and truncated chunked bodies, lying Content-Lengths, compressed bodies, pipelining)."""
from __future__ import annotations

import json
import random

SURROGATES = ["\ud800", "hi\udc00"]
ROUTES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/pause_generation": {"mode": "keep"}, "/resume_generation": {}, "/update_weights": {"path": "/tmp"},
    "/suspend": {"tags": ["kv_cache"]}, "/resume": {"tags": ["kv_cache"]},
    "/update_weights_from_ipc": {"handles": "x"}, "/destroy_weight_transfer": {},
    "/abort_requests": {"request_ids": [123456789]},
}
"""Every POST route, with a body near a valid one (the admin ones harmless: they are resumed after)."""
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
          "stop", "seed", "logprobs", "top_logprobs", "echo", "logit_bias", "tools", "tool_choice", "min_tokens",
          "mode", "path", "version", "tags", "handles", "request_ids", "unknown_field"]


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 1, 3, 300, 2**31, 10**30, -10**30])
    if kind == 3:
        return rng.choice([0.5, -2.5, 1e308, float("inf"), float("nan")])
    if kind == 4:
        return rng.choice(["", "x", "hi", "<|endoftext|>", "x" * 100_000, *SURROGATES])
    if kind == 5:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(12)))
    if kind == 6:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(FIELDS): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def random_body(rng: random.Random, base: dict) -> bytes:
    pick = rng.randrange(8)
    if pick == 0:
        d = rng.randrange(1, 200_000)
        return b'{"max_tokens": ' + b"[" * d + b"]" * d + b"}"
    if pick == 1:
        return b'{"max_tokens": ' + b"7" * rng.randrange(4000, 6000) + b"}"
    if pick == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if pick == 3:
        return json.dumps(random_json(rng)).encode()
    changes = {rng.choice(FIELDS): random_json(rng) for _ in range(rng.randrange(1, 4))}
    return json.dumps({**base, "stream": rng.random() < 0.3, **changes}).encode()


def raw_cases(host: str, port: int) -> list[tuple[str, bytes]]:
    """(name, bytes to write) of requests no client library sends."""
    h = f"Host: {host}:{port}\r\n".encode()
    body = b'{"prompt": "hi", "max_tokens": 2}'
    cl = str(len(body)).encode()
    post = b"POST /v1/completions HTTP/1.1\r\n" + h + b"Content-Type: application/json\r\n"
    cases = [
        ("empty line", b"\r\n\r\n"),
        ("garbage", b"\x00\x01\x02 hello\r\n\r\n"),
        ("no version", b"GET /health\r\n\r\n"),
        ("bad version", b"GET /health HTTP/9.9\r\n" + h + b"\r\n"),
        ("lower-case method", b"get /health HTTP/1.1\r\n" + h + b"\r\n"),
        ("unknown method", b"BREW /v1/completions HTTP/1.1\r\n" + h + b"\r\n"),
        ("absolute URI", b"GET http://evil.example/health HTTP/1.1\r\n" + h + b"\r\n"),
        ("path traversal", b"GET /../../etc/passwd HTTP/1.1\r\n" + h + b"\r\n"),
        ("percent-encoded NUL", b"GET /v1/models%00 HTTP/1.1\r\n" + h + b"\r\n"),
        ("huge path", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n" + h + b"\r\n"),
        ("huge header", b"GET /health HTTP/1.1\r\n" + h + b"X-Big: " + b"b" * 70_000 + b"\r\n\r\n"),
        ("many headers", b"GET /health HTTP/1.1\r\n" + h + b"".join(b"X-%d: 1\r\n" % i for i in range(2000)) + b"\r\n"),
        ("header without colon", b"GET /health HTTP/1.1\r\n" + h + b"NoColon\r\n\r\n"),
        ("header with NUL", b"GET /health HTTP/1.1\r\n" + h + b"X-A: a\x00b\r\n\r\n"),
        ("HTTP/1.0", b"GET /health HTTP/1.0\r\n\r\n"),
        ("no Host", b"GET /health HTTP/1.1\r\n\r\n"),
        ("two Content-Lengths", post + b"Content-Length: " + cl + b"\r\nContent-Length: 5\r\n\r\n" + body),
        ("negative Content-Length", post + b"Content-Length: -5\r\n\r\n" + body),
        ("Content-Length not a number", post + b"Content-Length: abc\r\n\r\n" + body),
        ("Content-Length too long", post + b"Content-Length: 99999999999999999999999\r\n\r\n" + body),
        ("Content-Length short", post + b"Content-Length: 5\r\n\r\n" + body),
        ("chunked", post + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"),
        ("chunked bad size", post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n"),
        ("chunked huge size", post + b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n" + body + b"\r\n0\r\n\r\n"),
        ("chunked no end", post + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(body) + body + b"\r\n"),
        ("chunked and Content-Length", post + b"Transfer-Encoding: chunked\r\nContent-Length: " + cl + b"\r\n\r\n"
         + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"),
        ("unknown Transfer-Encoding", post + b"Transfer-Encoding: gzip\r\n\r\n" + body),
        ("gzip body", post + b"Content-Encoding: gzip\r\nContent-Length: " + cl + b"\r\n\r\n" + body),
        ("br body", post + b"Content-Encoding: br\r\nContent-Length: " + cl + b"\r\n\r\n" + body),
        ("Expect 100-continue", post + b"Expect: 100-continue\r\nContent-Length: " + cl + b"\r\n\r\n" + body),
        ("pipelined", (b"GET /health HTTP/1.1\r\n" + h + b"\r\n") * 3 + post + b"Content-Length: " + cl + b"\r\n\r\n"
         + body),
        ("upgrade h2c", b"GET /health HTTP/1.1\r\n" + h + b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
         b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"),
        ("websocket", b"GET /v1/models HTTP/1.1\r\n" + h + b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
         b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"),
        ("TLS hello on plain HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64),
        ("bad JSON content type", post.replace(b"application/json", b"application/json; charset=latin-1")
         + b"Content-Length: " + cl + b"\r\n\r\n" + body),
        ("Authorization garbage", b"GET /v1/models HTTP/1.1\r\n" + h + b"Authorization: Bearer \xff\xfe\x00\r\n\r\n"),
    ]
    paths = ["/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/pause_generation",
             "/update_weights", "/nope"]
    for method in ("GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"):
        for path in paths:
            cases.append((f"{method} {path}", f"{method} {path} HTTP/1.1\r\n".encode() + h
                          + b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"))
    return cases
