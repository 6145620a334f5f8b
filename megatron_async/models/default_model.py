"""Built-in models with seeded random weights, for running the engine without a checkpoint.
Every rank draws the same FULL tensors and keeps its TP / EP shard, so a built-in model is the
same model whatever the parallel sizes."""
from __future__ import annotations

from typing import Iterator

import torch

from megatron_async.models.checkpoint import resolve_dtype
from megatron_async.models.decoder import DecoderModel
from megatron_async.models.gpt import GPTModel, build_gpt
from megatron_async.models.quantization import Fp8Config
from megatron_async.models.tiny_tokenizer import EOS_TOKEN_ID
from megatron_async.parallel.state import ParallelState

_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "use_sliding_window": False,
}

# What the released Qwen3 checkpoints share (tokenizer, context length, head size, dtype).
_QWEN3_RELEASED = {
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "dtype": "bfloat16",
}

DEFAULT_CONFIGS: dict[str, dict] = {
    # Runs in milliseconds per step on CPU; its vocabulary is the tiny test tokenizer's
    # (megatron_async.models.tiny_tokenizer, default vocab_size=1024).
    "tiny": {
        **_QWEN3_COMMON,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "initializer_range": 0.1,
        "eos_token_id": EOS_TOKEN_ID,
        "dtype": "float32",
    },
    # The shape of Qwen/Qwen3-30B-A3B (48 layers, 128 experts, top-8): ~30.5B parameters, 61 GB in bf16.
    "qwen3-30b-a3b": {
        **_QWEN3_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        **_QWEN3_RELEASED,
        "tie_word_embeddings": False,
    },
    # The shape of Qwen/Qwen3-0.6B.
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        **_QWEN3_RELEASED,
        "tie_word_embeddings": True,
    },
    # The shape of Qwen/Qwen3-8B (~8.2B parameters, 16.4 GB in bf16): a size where tensor
    # parallelism pays (python -m benchmarks tp-scaling).
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        **_QWEN3_RELEASED,
        "tie_word_embeddings": False,
    },
}

# A tiny Qwen3-MoE (8 experts, top-2, normalised; layer 1 dense) on the tiny tokenizer's
# vocabulary: the CPU model for expert-parallel runs (experts split 2, 4 or 8 ways).
DEFAULT_CONFIGS["tiny-moe"] = {
    **DEFAULT_CONFIGS["tiny"],
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 192,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
}


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
