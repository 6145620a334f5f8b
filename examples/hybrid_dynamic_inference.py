#!/usr/bin/env python
"""The main job for a hybrid Mamba2 + attention checkpoint (NemotronH, Bamba, Mamba2).

Same flags as gpt_dynamic_inference.py, but --model is required: there is no built-in hybrid model.

    python examples/hybrid_dynamic_inference.py --model /path/to/nemotron_h_checkpoint
"""
import sys

from megatron_async.cli.main_job import cli_main

if __name__ == "__main__":
    sys.exit(cli_main(__doc__.splitlines()[0], require_model=True))
