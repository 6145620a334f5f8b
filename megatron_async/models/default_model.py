"""Built-in models with seeded random weights, for running the engine without a checkpoint.
Every rank draws the same FULL tensors and keeps its TP / EP shard, so a built-in model is the
same model whatever the parallel sizes."""
from __future__ import annotations

from typing import Iterator

import torch

from megatron_async.models.checkpoint import resolve_dtype
from megatron_async.models.default_configs import DEFAULT_CONFIGS
from megatron_async.models.decoder import DecoderModel
from megatron_async.models.gpt import GPTModel, build_gpt
from megatron_async.models.quantization import Fp8Config
from megatron_async.parallel.state import ParallelState

def random_hf_weights(model: DecoderModel, std: float, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded FULL tensors in the Hugging Face layout, one at a time, in a fixed name order (see
    ``random_hf_tensors``). Every rank draws the same full tensors and its weight loaders keep its
    shard, so the model is the same whatever the TP size."""
    shapes = {name: shape for name, shape in model.hf_shapes().items() if not model.optional_hf_name(name)}
    param = model.embed_tokens.weight  # the model dtype (FP8 linears quantize these at load)
    return random_hf_tensors(shapes, param.dtype, param.device, std, seed)


@torch.no_grad()
def random_hf_tensors(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device, std: float,
                      seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """N(0, std) matrices, unit norm weights, zero biases, drawn in ``shapes``' order from one
    generator on ``device`` (CPU and CUDA give different, each reproducible, weights)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes.items():
        if "norm" in name:
            yield name, torch.ones(shape, dtype=dtype, device=device)
        elif len(shape) == 1:
            yield name, torch.zeros(shape, dtype=dtype, device=device)
        else:
            yield name, torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)


def build_default_model(
    name: str = "tiny", device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None, seed: int = 0,
    parallel: ParallelState | None = None, quantization: str | None = None,
) -> GPTModel:
    """One of DEFAULT_CONFIGS with seeded random weights, built directly on ``device`` (this
    rank's shard under ``parallel``). dtype None = the config's dtype. ``quantization="fp8"``:
    the same random weights quantized to FP8 at load."""
    if name not in DEFAULT_CONFIGS:
        raise ValueError(f"unknown default model {name!r}; choose from {', '.join(DEFAULT_CONFIGS)}")
    cfg = DEFAULT_CONFIGS[name]
    model = build_gpt(cfg, resolve_dtype(dtype, cfg), torch.device(device), parallel,
                      Fp8Config.resolve(quantization, None))
    model.load_hf_weights(random_hf_weights(model, cfg["initializer_range"], seed))
    return model.eval()
