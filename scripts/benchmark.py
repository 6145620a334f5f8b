#!/usr/bin/env python
"""Side-by-side benchmark (HF generate, HF continuous batching, this engine serial / async /
async + CUDA graphs) on one workload and one set of weights. `--smoke` runs in seconds on CPU.

    python scripts/benchmark.py                 # GPU: Qwen3-0.6B-shaped bf16 model, 256 requests
    python scripts/benchmark.py --smoke         # CPU, tiny model
"""
from megatron_async.tools.side_by_side import main

if __name__ == "__main__":
    main()
