"""The built-in models' Hugging Face configs (plain data: parsing ``--default-model`` needs no torch;
models/default_model.py builds them with seeded random weights)."""
from __future__ import annotations

from megatron_async.models.tiny_tokenizer import EOS_TOKEN_ID

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
