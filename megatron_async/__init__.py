"""megatron_async: dynamic-batching LLM inference whose GPU never waits for its CPU.

The names below load on first use (PEP 562), so that a process importing only a torch-free part
of the package (the server's HTTP front-ends) does not import torch."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_async.config import InferenceConfig
    from megatron_async.inference.request import InvalidRequestError, RequestOutput, RequestUpdate, SamplingParams
    from megatron_async.llm import LLM

_EXPORTS = {"LLM": "megatron_async.llm", "InferenceConfig": "megatron_async.config",
            **{n: "megatron_async.inference.request"
               for n in ("SamplingParams", "RequestOutput", "RequestUpdate", "InvalidRequestError")}}
__all__ = ["LLM", "SamplingParams", "InferenceConfig", "RequestOutput", "RequestUpdate", "InvalidRequestError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_async' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
    return value
