"""Load a Hugging Face-format checkpoint directory (config.json + safetensors) into a CausalLM."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from megatron_async.models.registry import get_builder
from megatron_async.models.base import CausalLM
from megatron_async.models.quantization import Fp8Config
from megatron_async.parallel.state import ParallelState

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def resolve_dtype(dtype: torch.dtype | str | None, hf_config: dict | None = None) -> torch.dtype:
    """torch.dtype, its name ("bfloat16", "torch.float16"), or None = the checkpoint's dtype (float32 if unset)."""
    if dtype is None:
        dtype = (hf_config or {}).get("dtype") or (hf_config or {}).get("torch_dtype") or "float32"
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown floating-point dtype {dtype!r}")
    return resolved


def read_json_file(path: Path) -> dict:
    """A JSON object from ``path``; a malformed file raises ValueError naming it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_hf_config(path: str | Path) -> dict:
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"checkpoint directory {str(root)!r} does not exist")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ValueError(f"checkpoint {str(root)!r} has no config.json")
    return read_json_file(config_file)


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint: model.safetensors, or the shards its index names."""
    root = Path(path)
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    index = root / INDEX_FILE
    if not index.is_file():
        raise ValueError(f"checkpoint {str(root)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    weight_map = read_json_file(index).get("weight_map")
    if not weight_map:
        raise ValueError(f"{index} has no 'weight_map'")
    files = [root / name for name in sorted(set(weight_map.values()))]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"{index} names shard files that do not exist: {', '.join(absent)}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time so that only one tensor is in host memory at once.
    A damaged file (truncated, bad header) raises ValueError naming it."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from e


def load_checkpoint(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None,
    parallel: ParallelState | None = None, quantization: str | None = None,
) -> tuple[CausalLM, dict]:
    """Build the model named by ``config.json``'s ``architectures[0]`` on ``device`` in ``dtype``
    (None: the checkpoint's dtype) and fill it from the checkpoint's safetensors: under tensor
    parallelism, this rank's shard (``parallel``; None = a single process). FP8: a checkpoint
    with an FP8 ``quantization_config`` loads as it is; ``quantization="fp8"`` quantizes a float
    checkpoint's linears at load (models/quantization.py).

    Returns (model in eval mode, the config.json dict)."""
    hf_config = read_hf_config(path)
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ValueError(f"{Path(path) / 'config.json'} has no 'architectures' entry")
    files = safetensors_files(path)
    builder = get_builder(archs[0])
    quant = Fp8Config.resolve(quantization, hf_config)
    model = builder(hf_config, resolve_dtype(dtype, hf_config), torch.device(device), parallel or ParallelState(),
                    quant=quant)
    try:
        model.load_hf_weights(iter_safetensors(files))
    except ValueError as e:
        raise ValueError(f"checkpoint {str(path)!r}: {e}") from e
    return model.eval(), hf_config
