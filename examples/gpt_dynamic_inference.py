#!/usr/bin/env python
"""The main job: a GPT (Llama/Qwen) model on the dynamic engine over a synthetic or text-prompt workload.

    python examples/gpt_dynamic_inference.py                      # built-in model, seconds on CPU
    python examples/gpt_dynamic_inference.py --model CKPT --prompt-file prompts.txt --output-path out.json
    python examples/gpt_dynamic_inference.py --model CKPT --chat --prompts "What is the capital of France?" \
        --num-tokens-to-generate 64 --top-k 1                  # CKPT=$(python scripts/fetch_smollm2.py)
"""
import sys

from megatron_async.cli.main_job import cli_main

if __name__ == "__main__":
    sys.exit(cli_main(__doc__.splitlines()[0]))
