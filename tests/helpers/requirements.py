"""Optional packages of a test: skipped where missing, except where the run says it must have
them (``MEGATRON_ASYNC_TEST_REQUIRES=torch_memory_saver,...``, as scripts/gpu_validation.sh
sets after installing them): there a missing one fails the test instead of hiding it."""
from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

REQUIRES_ENV = "MEGATRON_ASYNC_TEST_REQUIRES"


def required_modules() -> set[str]:
    return {m.strip() for m in os.environ.get(REQUIRES_ENV, "").split(",") if m.strip()}


def need(module: str):
    """The module, imported; a skip where it is missing, a failure where the run requires it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if module in required_modules():
            pytest.fail(f"{module} is required here ({REQUIRES_ENV}) but cannot be imported: {e}", pytrace=False)
        pytest.skip(f"could not import {module!r}: {e}")


def installed(*modules: str) -> bool:
    """Whether every module can be found, without importing it: for a skip mark on a module whose
    import alone takes seconds (Megatron-Core's), which every test worker would pay at collection."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False
