"""Stand-alone MoE mixers with seeded full Hugging Face tensors, for layer-level tests of the
routed experts (expert / tensor parallel shards against the full layer)."""
from __future__ import annotations

import torch
from torch import nn

from megatron_async.models.layers.moe import MoEMixer
from megatron_async.models.moe_config import MoEConfig, RouterScore
from megatron_async.models.weight_loading import hf_targets, load_hf_weights
from megatron_async.parallel.sharding import full_shape
from megatron_async.parallel.state import ParallelState

SOFTMAX_MOE = MoEConfig(8, 2, 24, gated=True, score=RouterScore.SOFTMAX, norm_topk_prob=True,
                        hf_gate="gate_proj", hf_up="up_proj", hf_down="down_proj", weights_in_model_dtype=True)
SIGMOID_MOE = MoEConfig(8, 3, 16, gated=False, score=RouterScore.SIGMOID, norm_topk_prob=True, hf_gate=None,
                        hf_up="up_proj", hf_down="down_proj", num_groups=4, topk_groups=2, routed_scaling_factor=2.0,
                        score_correction_bias=True, router_in_fp32=True, shared_expert_intermediate_size=20,
                        latent_size=12, mlp_bias=True)
MOE_CONFIGS = {"softmax": SOFTMAX_MOE, "sigmoid": SIGMOID_MOE}
QWEN3_30B_MOE = MoEConfig(128, 8, 768, gated=True, score=RouterScore.SOFTMAX, norm_topk_prob=True,
                          hf_gate="gate_proj", hf_up="up_proj", hf_down="down_proj", weights_in_model_dtype=True)
QWEN3_30B_HIDDEN = 2048
"""A Qwen3-30B-A3B MoE layer: hidden 2048, 128 experts, top-8, moe_intermediate 768 (the real
shape of the MoE GPU tests and timings; bf16, weights N(0, 0.02): ``qwen3_30b_moe_layer``)."""


def build_moe_layer(cfg: MoEConfig, hidden: int, parallel: ParallelState, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", seed: int = 0, scale: float = 0.3, init_device: str = "cpu") -> MoEMixer:
    """A MoEMixer (this rank's shard) filled from seeded full HF tensors named ``mlp.*`` (N(0,
    scale^2), drawn on ``init_device``): the same full tensors whatever ``parallel`` is, so every
    shard is a slice of the full layer."""
    holder = nn.ModuleDict({"mixer": MoEMixer(hidden, cfg, parallel, dtype, device)})
    targets = hf_targets(holder, {"mixer": "mlp"})
    gen = torch.Generator(device=init_device).manual_seed(seed)
    weights = [(name, (torch.randn(full_shape(param, sid), generator=gen, device=init_device) * scale).to(dtype))
               for name, (param, sid) in sorted(targets.items())]
    load_hf_weights(targets, weights, skip=lambda name: False, what="MoE layer")
    return holder["mixer"].eval()


def qwen3_30b_moe_layer(parallel: ParallelState | None = None, seed: int = 0) -> MoEMixer:
    """``QWEN3_30B_MOE`` on CUDA in bf16, weights N(0, 0.02) drawn on the GPU (every rank draws
    the same full tensors: an expert-parallel shard is a slice of the one-GPU layer)."""
    return build_moe_layer(QWEN3_30B_MOE, QWEN3_30B_HIDDEN, parallel or ParallelState(), torch.bfloat16, "cuda", seed,
                           scale=0.02, init_device="cuda")
