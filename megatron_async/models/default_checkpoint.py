"""The built-in random-weight models (``models/default_model.py``) written as Hugging Face
checkpoints, so that another program (a ``transformers`` trainer in ``examples/rl_rollout_loop.py``,
the HF peers of the benchmarks) loads exactly the weights the engine builds. Needs ``transformers``
(for the model's full ``config.json``)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from megatron_async.models.default_model import DEFAULT_CONFIGS, random_hf_tensors

SHARD_BYTES = 4 << 30
"""Largest safetensors shard ``save_default_checkpoint`` writes."""


def save_default_checkpoint(name: str, path: str | Path, device: torch.device, dtype: torch.dtype, seed: int = 0,
                            shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the built-in model ``name`` as a Hugging Face checkpoint and return the directory:
    config.json and safetensors shards of the engine's own seeded random weights (the tensors
    ``build_default_model`` loads, in HF names, drawn on ``device``), the engine and HF then load
    the same weights. Shard by shard from the shapes of a meta-device model: memory holds one
    shard, never the model (transformers' own save of a MoE model converts its fused experts
    and held the 30B-A3B model twice)."""
    import transformers
    from safetensors.torch import save_file

    from megatron_async.models.gpt import build_gpt

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = dict(DEFAULT_CONFIGS[name])
    shapes = build_gpt(cfg, dtype, torch.device("meta")).hf_shapes()
    arch = cfg.pop("architectures")[0]
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.architectures = [arch]
    config.dtype = dtype
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config.to_json_file(root / "config.json")
    shards = _shard_names(shapes, dtype, shard_bytes)
    files = sorted(set(shards.values()))
    if len(files) > 1:
        total = sum(math.prod(s) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()
        (root / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": shards}, indent=1))
    shard: dict[str, torch.Tensor] = {}
    file = files[0]
    for key, tensor in random_hf_tensors(shapes, dtype, device, DEFAULT_CONFIGS[name]["initializer_range"], seed):
        if shards[key] != file:  # shards hold consecutive tensors: the previous one is complete
            save_file(shard, root / file, metadata={"format": "pt"})
            shard, file = {}, shards[key]
        shard[key] = tensor.cpu()
    save_file(shard, root / file, metadata={"format": "pt"})
    return root


def _shard_names(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, shard_bytes: int) -> dict[str, str]:
    """Tensor name -> file: consecutive tensors fill a shard up to ``shard_bytes`` (HF's names)."""
    elt = torch.empty((), dtype=dtype).element_size()
    index, size, which = 0, 0, {}
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * elt
        if size and size + nbytes > shard_bytes:
            index, size = index + 1, 0
        which[name], size = index, size + nbytes
    n = index + 1
    return {k: "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors" for k, i in which.items()}
