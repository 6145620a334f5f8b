#!/usr/bin/env python
"""The main job: a GPT (Llama/Qwen) model on the dynamic engine over a synthetic or file workload.

    python examples/gpt_dynamic_inference.py                      # built-in model, seconds on CPU
    python examples/gpt_dynamic_inference.py --model CKPT --prompt-file prompts.txt --output-path out.json
    python examples/gpt_dynamic_inference.py --benchmark --smoke  # the side-by-side benchmark
"""
from megatron_async.tools.main_job import main

if __name__ == "__main__":
    main(description=__doc__.splitlines()[0])
