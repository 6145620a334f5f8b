"""Models: GPT / hybrid decoders, HF checkpoint loading, tokenizer, built-in default models.
The names below load on first use (a tokenizer or chat template alone needs no torch)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_async.models.checkpoint import load_checkpoint
    from megatron_async.models.default_configs import DEFAULT_CONFIGS
    from megatron_async.models.default_model import build_default_model
    from megatron_async.models.tokenizer import Tokenizer, load_tokenizer

_EXPORTS = {"load_checkpoint": "megatron_async.models.checkpoint", "DEFAULT_CONFIGS": "megatron_async.models.default_configs",
            "build_default_model": "megatron_async.models.default_model", "Tokenizer": "megatron_async.models.tokenizer",
            "load_tokenizer": "megatron_async.models.tokenizer"}
__all__ = ["DEFAULT_CONFIGS", "Tokenizer", "build_default_model", "load_checkpoint", "load_tokenizer"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_async.models' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
    return value
