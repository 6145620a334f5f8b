#!/usr/bin/env python
"""Loopback load test of the OpenAI-compatible server: 64 concurrent streaming clients, 500
requests, none lost or duplicated; prints p50/p99 TTFT and inter-token latency.

    python scripts/load_test.py --model CKPT [server flags after --]     # starts its own server
    python scripts/load_test.py --url http://127.0.0.1:8000 --served-model-name NAME
    python scripts/load_test.py --model CKPT -- --max-requests 64 --serial
    python scripts/load_test.py --token-prompts --warmup-requests 128 -- --default-model qwen3-0.6b --device cuda

Without --url it starts ``python -m megatron_async.serve`` on a free loopback port with --model (if
given) and the flags after ``--``. A warm-up load (Triton compiles, CUDA graph captures) runs
first and is not reported. Exit code 1 when a request is lost, duplicated, failed or short.
"""
import argparse
import json
import sys

from megatron_async.serve.process import ServerProcess
from megatron_async.tools.cli import NON_NEGATIVE_INT, POSITIVE_INT, HelpFormatter
from megatron_async.tools.load_test import LoadTestReport, run_load_test_processes, server_side_summary


def main() -> int:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--model", help="checkpoint dir of the server to start (default: the server's built-in model)")
    target.add_argument("--url", help="base URL of a running server (default: start one on a free loopback port)")
    p.add_argument("--served-model-name", default=None, help="with --url: the model to request (default: the server's)")
    p.add_argument("--clients", type=POSITIVE_INT, default=64)
    p.add_argument("--client-processes", type=POSITIVE_INT, default=1,
                   help="spread the clients over this many processes (one process saturates at a few thousand chunks/s)")
    p.add_argument("--requests", type=POSITIVE_INT, default=500)
    p.add_argument("--max-tokens", type=POSITIVE_INT, default=32, help="tokens per request (EOS ignored)")
    p.add_argument("--prompt-words", type=POSITIVE_INT, default=12, help="prompt length (words, or ids with --token-prompts)")
    p.add_argument("--token-prompts", action="store_true", help="token-id prompts (a model without a tokenizer)")
    p.add_argument("--warmup-requests", type=NON_NEGATIVE_INT, default=0, help="an unreported load run first")
    p.add_argument("--start-timeout", type=POSITIVE_INT, default=300, help="seconds the server may take to start")
    p.add_argument("--output-path", default=None, help="write the report as JSON")
    args = p.parse_args(argv)

    def run(url: str, model: str | None) -> LoadTestReport:
        if args.warmup_requests:
            warm = load(url, model, args.warmup_requests)
            print(f"warm-up: {warm.format().splitlines()[0]}", flush=True)
        return load(url, model, args.requests)

    def load(url: str, model: str | None, requests: int) -> LoadTestReport:
        return run_load_test_processes(url, model, args.client_processes, args.clients, requests, args.max_tokens,
                                       args.prompt_words, token_prompts=args.token_prompts)

    if args.url:
        report = run(args.url.rstrip("/"), args.served_model_name)
        print(server_side_summary(args.url.rstrip("/")))
    else:
        model_args = ["--model", args.model] if args.model else []
        with ServerProcess([*model_args, *server_args], start_timeout_s=args.start_timeout) as srv:
            print(f"server: {srv.model_name} at {srv.url} ({' '.join(model_args + server_args)})", flush=True)
            report = run(srv.url, srv.model_name)
            print(server_side_summary(srv.url))
    print(report.format())
    if args.output_path:
        with open(args.output_path, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
