"""The server's flags for who may call it and what one request may hold (keys, TLS, CORS, the
weights directory, body limits), turned into the ``HttpPolicy`` every route enforces
(http_guard.py), and the refusal to start the admin endpoints where anyone could reach them."""
from __future__ import annotations

import argparse
import os

from megatron_async.cli import flags
from megatron_async.serve.http_guard import DEFAULT_BODY_TIMEOUT_S, HttpPolicy, is_loopback
from megatron_async.serve.server_state import PROMPTS_PER_BODY_FACTOR

API_KEY_ENV = "MEGATRON_ASYNC_API_KEY"


def add_http_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("access and limits")
    g.add_argument("--api-key", default=None,
                   help=f"every /v1 route needs 'Authorization: Bearer KEY' (401 without it); default: ${API_KEY_ENV}, "
                        "else none. /health stays open")
    g.add_argument("--admin-api-key", default=None,
                   help="the key of the admin endpoints (default: the API key); needed to serve them on a "
                        "host other than loopback")
    g.add_argument("--metrics-need-api-key", action="store_true", help="/metrics needs the API key too (default: open)")
    g.add_argument("--allowed-weights-dir", default=None,
                   help="/update_weights loads only from directories under this one (a path resolving outside it, "
                        "through '..' or a symlink, is a 403); default: anywhere")
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
