"""The kernel families of ``python -m benchmarks kernel-times``, one module each with
``add_arguments(parser)`` and ``run(args)``; the subcommand's name is the module's with dashes."""
from __future__ import annotations

import importlib
from types import ModuleType

NAMES = ["paged-attention", "prefill-attention", "attention-read-bound", "mamba-kernels", "mamba-mixed", "fused-elementwise", "small-kernels", "sampler-kernels", "log-probs", "swiglu-matmul", "invariant-kernels", "graph-variants", "fused-moe", "ep-exchange", "lora", "kv-chunks", "decode-splits"]


def module(name: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.kernel_times.{name.replace('-', '_')}")
