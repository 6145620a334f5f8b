"""The engine-level GPU measurements of ``python -m benchmarks engine-times``, one module each with
``add_arguments(parser)`` and ``run(args)``; the subcommand's name is the module's with dashes."""
from __future__ import annotations

import importlib
from types import ModuleType

NAMES = ["hybrid-graphs", "speculative-gpu", "mtp-speculation", "batch-invariance", "mode-costs"]


def module(name: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.engine_times.{name.replace('-', '_')}")
