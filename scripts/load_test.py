#!/usr/bin/env python
"""Loopback load test of the OpenAI-compatible server: 64 concurrent streaming clients, 500
requests, none lost or duplicated; prints p50/p99 TTFT and inter-token latency.

    python scripts/load_test.py --model CKPT [server flags after --]     # starts its own server
    python scripts/load_test.py --url http://127.0.0.1:8000 --served-model-name NAME
    python scripts/load_test.py --model CKPT -- --max-requests 64 --serial
"""
import argparse
import asyncio
import json
import sys

from megatron_async.serve.process import ServerProcess
from megatron_async.tools.cli import POSITIVE_INT, HelpFormatter
from megatron_async.tools.load_test import run_load_test


def main() -> int:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--model", help="checkpoint dir: start a server on a free loopback port")
    target.add_argument("--url", help="base URL of a running server")
    p.add_argument("--served-model-name", default=None, help="with --url: the model to request (default: the server's)")
    p.add_argument("--clients", type=POSITIVE_INT, default=64)
    p.add_argument("--requests", type=POSITIVE_INT, default=500)
    p.add_argument("--max-tokens", type=POSITIVE_INT, default=32, help="tokens per request (EOS ignored)")
    p.add_argument("--prompt-words", type=POSITIVE_INT, default=12)
    p.add_argument("--output-path", default=None, help="write the report as JSON")
    args = p.parse_args(argv)

    def run(url: str, model: str):
        return asyncio.run(run_load_test(url, model, args.clients, args.requests, args.max_tokens, args.prompt_words))

    if args.url:
        report = run(args.url.rstrip("/"), args.served_model_name)
    else:
        with ServerProcess(["--model", args.model, *server_args]) as srv:
            report = run(srv.url, srv.model_name)
    print(report.format())
    if args.output_path:
        with open(args.output_path, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
