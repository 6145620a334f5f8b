"""HF ``architectures`` name -> builder. Builders take (hf_config: dict, dtype, device, parallel:
ParallelState) and return a ``CausalLM`` with uninitialised (or seeded random) weights."""
from __future__ import annotations

import importlib
from typing import Callable

_BUILDERS: dict[str, str] = {
    "LlamaForCausalLM": "megatron_async.models.gpt:build_gpt",
    "Qwen2ForCausalLM": "megatron_async.models.gpt:build_gpt",
    "Qwen3ForCausalLM": "megatron_async.models.gpt:build_gpt",
    "Qwen3MoeForCausalLM": "megatron_async.models.gpt:build_gpt",
    "MixtralForCausalLM": "megatron_async.models.gpt:build_gpt",
    "NemotronHForCausalLM": "megatron_async.models.hybrid:build_hybrid",
    "BambaForCausalLM": "megatron_async.models.hybrid:build_hybrid",
    "Mamba2ForCausalLM": "megatron_async.models.hybrid:build_hybrid",
}


def supported_architectures() -> list[str]:
    return sorted(_BUILDERS)


def get_builder(architecture: str) -> Callable:
    if architecture not in _BUILDERS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module, fn = _BUILDERS[architecture].split(":")
    return getattr(importlib.import_module(module), fn)
