#!/usr/bin/env python
"""Loopback load test of the OpenAI-compatible server: 64 concurrent streaming clients, 500
requests, none lost or duplicated; prints p50/p99 TTFT and inter-token latency.

    python -m benchmarks load-test --model CKPT [server flags after --]     # starts its own server
    python -m benchmarks load-test --url http://127.0.0.1:8000 --served-model-name NAME
    python -m benchmarks load-test --model CKPT -- --max-requests 64 --serial
    python -m benchmarks load-test --token-prompts --warmup-requests 128 -- --default-model qwen3-0.6b --device cuda

Without --url it starts ``python -m megatron_async.serve`` on a free loopback port with --model (if
given) and the flags after ``--``. A warm-up load (Triton compiles, CUDA graph captures) runs
first and is not reported. Exit code 1 when a request is lost, duplicated, failed or short.
"""
import sys

from benchmarks.server_load import main

if __name__ == "__main__":
    sys.exit(main())
