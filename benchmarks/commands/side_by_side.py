#!/usr/bin/env python
"""Side-by-side benchmark (HF generate, HF continuous batching, this engine serial / async /
async + CUDA graphs) on one workload and one set of weights. `--smoke` runs in seconds on CPU.

    python -m benchmarks side-by-side                 # GPU: Qwen3-0.6B-shaped bf16 model, 256 requests
    python -m benchmarks side-by-side --smoke         # CPU, tiny model
"""
from benchmarks.side_by_side import main

if __name__ == "__main__":
    main()
