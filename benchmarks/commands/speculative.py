#!/usr/bin/env python
"""Speculative decoding vs plain decoding, tok/s (oracle acceptance sweep, n-gram on a
repetitive workload). `--smoke` runs in seconds on CPU.

    python -m benchmarks speculative            # GPU: qwen3-0.6b-shaped bf16 model
    python -m benchmarks speculative --smoke    # CPU, tiny model
"""
from benchmarks.bench_speculative import main

if __name__ == "__main__":
    main()
