"""What every HTTP request goes through before its route: an ASGI middleware (``HttpGuard``), so
that every route, whichever module adds it, gets the same treatment.

- **Keys.** Routes fall in four classes (``route_class``): ``/health`` is open; ``/metrics`` is
  open unless ``metrics_need_key``; the OpenAI API (``/v1/...``, ``/tokenize``, ``/detokenize``)
  needs ``Authorization: Bearer <api_key>`` when an API key is set; every other path (the admin
  operations, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` included) needs the
  admin key, or the API key where no admin key is set. A missing or wrong key is a 401 with
  OpenAI's error object; keys are compared in constant time (``hmac`` on their SHA-256) and
  never written to a log or an answer.
- **Bodies** (POST / PUT / PATCH) are read here, whole, before the route runs: a
  ``Content-Encoding`` other than identity is a 415, a body over ``max_request_bytes`` a 413
  (the server's ``--max-request-bytes``; refused from its Content-Length before a byte is read),
  a body not complete ``body_timeout_s`` after the request's head a 408 (one INFO line; the
  connection then closes). A client that leaves mid-upload gets no answer and costs one DEBUG
  line; one whose body the HTTP parser rejects, uvicorn's one INFO line (launch.ClientFaultsAtInfo). The
  route never runs for either, and otherwise reads the body as usual, from memory. A client gone
  before its answer was sent is one DEBUG line too, never a traceback or a 500 sent after it.

``HttpPolicy`` holds the settings, built from the server's flags (``add_http_args``,
``policy_from_args``; ``refusal``: the flags the server must not start with, as the admin
endpoints where anyone could reach them); the engine's process and every front-end process build
the app with the same one."""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import os
from dataclasses import dataclass, field

from megatron_async.dp_engine.engine_ops import error_body

log = logging.getLogger("megatron_async.serve")

DEFAULT_BODY_TIMEOUT_S = 30.0
PROMPTS_PER_BODY_FACTOR = 4
"""Without --max-prompts-per-body, one body may ask for this many times --max-requests completions."""
API_PATHS = frozenset({"/tokenize", "/detokenize"})
"""API routes outside ``/v1`` (vLLM's names): they take the API key like the ``/v1`` routes."""
ADMIN_V1_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
"""Admin routes under ``/v1`` (vLLM's names): they take the admin key like the other admin routes."""
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True)
class HttpPolicy:
    """What ``HttpGuard`` enforces (the server's flags; see python -m megatron_async.serve --help)."""

    api_key: str | None = field(default=None, repr=False)
    """``--api-key`` / MEGATRON_ASYNC_API_KEY: needed by the API routes (None: open)."""
    admin_api_key: str | None = field(default=None, repr=False)
    """``--admin-api-key``: needed by the admin routes (None: the API key, if any)."""
    metrics_need_key: bool = False
    """``/metrics`` behind the API key too."""
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    allowed_origins: tuple[str, ...] = ()
    """CORS: origins whose browser pages may call the API (empty: CORS off)."""
    allowed_weights_dir: str | None = None
    """``/update_weights`` and ``/v1/load_lora_adapter`` load only from under this directory (None: anywhere)."""
    max_prompts_per_body: int | None = None
    """Engine requests (prompts x n) one body may ask for (None: a multiple of ``max_requests``)."""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None


def route_class(path: str) -> str:
    """"open", "metrics", "api" or "admin" (anything else: the admin operations and unknown paths)."""
    if path == "/health":
        return "open"
    if path == "/metrics":
        return "metrics"
    if path in ADMIN_V1_PATHS:
        return "admin"
    if path == "/v1" or path.startswith("/v1/") or path in API_PATHS:
        return "api"
    return "admin"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (what ``--host`` binds) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ClientGone(OSError):
    """A send to a client whose connection closed (an OSError: response classes that stop
    sending on one, as SSEResponse does, stop here too)."""


def _replay(body: bytes, receive):
    """``receive`` for the route: the whole body at once, then the real messages (the disconnect)."""
    replayed = False

    async def replay():
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class _Send:
    """Answers of the guard itself: OpenAI's error object. After a 408 the connection closes;
    after the others the server reads and drops what the client still sends (a client that
    writes its whole body before it reads then gets the answer, not a broken pipe)."""

    @staticmethod
    async def error(send, status: int, message: str, extra: tuple = ()) -> None:
        body = json.dumps(error_body(message, status)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class HttpGuard:
    """``app.add_middleware(HttpGuard, policy=HttpPolicy(...), max_request_bytes=N)``."""

    def __init__(self, app, policy: HttpPolicy, max_request_bytes: int):
        self.app, self.policy, self.max_request_bytes = app, policy, max_request_bytes
        self._api = _digest(policy.api_key) if policy.api_key else None
        admin = policy.admin_api_key or policy.api_key
        self._admin = _digest(admin) if admin else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        want = self._key_for(route_class(scope["path"]))
        if want is not None and not self._authorized(scope, want):
            return await _Send.error(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer "
                                     "<key>'", ((b"www-authenticate", b"Bearer"),))
        if scope["method"] in BODY_METHODS:
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
            receive = _replay(body, receive)

        async def guarded_send(message) -> None:
            try:
                await send(message)
            except (OSError, RuntimeError) as e:  # the transport closed under the answer
                raise ClientGone(str(e)) from None

        try:
            await self.app(scope, receive, guarded_send)
        except ClientGone as e:
            log.debug("%s %s: the client left before its answer was sent (%s)", scope["method"], scope["path"][:100], e)

    def _key_for(self, kind: str) -> bytes | None:
        if kind == "api" or kind == "metrics" and self.policy.metrics_need_key:
            return self._api
        return self._admin if kind == "admin" else None

    @staticmethod
    def _authorized(scope, want: bytes) -> bool:
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        return hmac.compare_digest(_digest(token.strip()), want) and scheme.lower() == b"bearer"

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once the request was answered here (or the client left)."""
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"", b"identity"):
            await _Send.error(send, 415, f"Content-Encoding {encoding.decode(errors='replace')[:40]!r} is not "
                                         "supported: send the body uncompressed")
            return None
        limit = self.max_request_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _Send.error(send, 400, "Content-Length is not a number")
                return None
            if int(declared) > limit:
                await _Send.error(send, 413, f"request body is {int(declared)} bytes; this server takes at most {limit}")
                return None
        return await self._receive_body(scope, receive, send, limit)

    async def _receive_body(self, scope, receive, send, limit: int) -> bytes | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.body_timeout_s
        parts, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                log.info("%s %s: body not complete after %g s: 408", scope["method"], scope["path"][:100],
                         self.policy.body_timeout_s)
                await _Send.error(send, 408, f"the request body did not arrive within {self.policy.body_timeout_s:g} s",
                                  ((b"connection", b"close"),))
                return None
            if message["type"] == "http.disconnect":
                log.debug("%s %s: the client left before its body was complete", scope["method"], scope["path"][:100])
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _Send.error(send, 413, f"request body is over {limit} bytes, the most this server takes")
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


# ---------------------------------------------------------------- the flags
API_KEY_ENV = "MEGATRON_ASYNC_API_KEY"


def add_http_args(p: argparse.ArgumentParser) -> None:
    from megatron_async.cli import flags  # (the front-end processes, which import this module, load no torch)

    g = p.add_argument_group("access and limits")
    g.add_argument("--api-key", default=None,
                   help=f"every /v1 route needs 'Authorization: Bearer KEY' (401 without it); default: ${API_KEY_ENV}, "
                        "else none. /health stays open")
    g.add_argument("--admin-api-key", default=None,
                   help="the key of the admin endpoints (default: the API key); needed to serve them on a "
                        "host other than loopback")
    g.add_argument("--metrics-need-api-key", action="store_true", help="/metrics needs the API key too (default: open)")
    g.add_argument("--allowed-weights-dir", default=None,
                   help="/update_weights and /v1/load_lora_adapter load only from directories under this one (a "
                        "path resolving outside it, through '..' or a symlink, is a 403); default: anywhere")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (and --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (and --ssl-keyfile)")
    g.add_argument("--allowed-origins", default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="CORS: the origins whose web pages may call the API ('*': any); default: CORS off")
    g.add_argument("--body-timeout-s", type=flags.checked(float, 0.1, 3600.0, name="body-timeout-s"),
                   default=DEFAULT_BODY_TIMEOUT_S,
                   help="a request body not complete this long after its headers is dropped with a 408")
    g.add_argument("--max-prompts-per-body", type=flags.checked(int, 1, name="max-prompts-per-body"), default=None,
                   help=f"most completions (prompts x n) one request body may ask for (400 beyond); default "
                        f"{PROMPTS_PER_BODY_FACTOR} x --max-requests")


def policy_from_args(args: argparse.Namespace) -> HttpPolicy:
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    weights = os.path.realpath(args.allowed_weights_dir) if args.allowed_weights_dir else None
    return HttpPolicy(api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, admin_api_key=args.admin_api_key,
                      metrics_need_key=args.metrics_need_api_key, body_timeout_s=args.body_timeout_s,
                      allowed_origins=origins, allowed_weights_dir=weights,
                      max_prompts_per_body=args.max_prompts_per_body, ssl_keyfile=args.ssl_keyfile,
                      ssl_certfile=args.ssl_certfile)


def refusal(args: argparse.Namespace, policy: HttpPolicy) -> str | None:
    """Why the server must not start with these flags (None: it may)."""
    if bool(policy.ssl_keyfile) != bool(policy.ssl_certfile):
        return "--ssl-keyfile and --ssl-certfile go together"
    for name in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(policy, name)
        if path and not os.path.isfile(path):
            return f"--{name.replace('_', '-')} {path!r} is not a file"
    if policy.allowed_weights_dir and not os.path.isdir(policy.allowed_weights_dir):
        return f"--allowed-weights-dir {args.allowed_weights_dir!r} is not a directory"
    if args.enable_admin_endpoints and not is_loopback(args.host) and not policy.admin_api_key:
        return (f"--enable-admin-endpoints on --host {args.host} (not loopback) needs --admin-api-key: anyone who "
                "can reach the port could replace the weights, pause generation or free device memory")
    return None
