"""Tiny random Hugging Face mixture-of-experts checkpoints (Qwen3-MoE, Mixtral, NemotronH with
MoE layers) for parity tests. Built from configs (no downloads), float32,
``initializer_range=0.2`` so greedy logit gaps are wide; norm weights, biases and NemotronH's
router correction bias are perturbed away from 1 / 0 so that a mis-mapped tensor shows."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.hf_hybrid_models import _redraw_mamba_params, make_tiny_hybrid_config
from tests.helpers.hf_models import perturb_norms_and_biases

MOE_ARCHS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "NemotronHForCausalLM")

_COMMON = {"vocab_size": 256, "hidden_size": 64, "initializer_range": 0.2, "eos_token_id": None,
           "bos_token_id": None, "pad_token_id": None}
TINY_DEFAULTS: dict[str, dict] = {
    # 3 layers: sparse, dense (mlp_only_layers), sparse; head_dim != hidden / heads
    "Qwen3MoeForCausalLM": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=512),
    "MixtralForCausalLM": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=512),
    # Mamba, MoE, attention, MoE; 8 experts in 4 groups, the best 2 groups eligible
    "NemotronHForCausalLM": dict(hybrid_override_pattern="ME*E", num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=12,
                                 ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=4,
                                 n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                 moe_shared_expert_intermediate_size=40, n_group=4, topk_group=2,
                                 routed_scaling_factor=2.5, norm_topk_prob=True, vocab_size=128),
}


def make_tiny_moe_config(arch: str, **overrides):
    import transformers

    if arch not in MOE_ARCHS:
        raise ValueError(f"make_tiny_moe_config: {arch!r} is not one of {MOE_ARCHS}")
    if arch == "NemotronHForCausalLM":
        return make_tiny_hybrid_config(arch, **{**_COMMON, **TINY_DEFAULTS[arch], **overrides})
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**{**_COMMON, **TINY_DEFAULTS[arch], **overrides})
    config.architectures = [arch]
    return config


@torch.no_grad()
def make_tiny_moe_checkpoint(arch: str, path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """A seeded random float32 HF ``arch`` MoE model saved with ``save_pretrained`` to ``path``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = make_tiny_moe_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    perturb_norms_and_biases(model, gen)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    _redraw_mamba_params(model, gen)
    root = Path(path)
    model.save_pretrained(root)
    return root
