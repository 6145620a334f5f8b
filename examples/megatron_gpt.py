"""A Megatron-Core GPTModel (local layer spec) of a Hugging Face Qwen3 / Qwen3-MoE / Llama config,
for the refit example and the reference tests, on CUDA as a trainer builds it or on CPU (gloo, no
Transformer-Engine).

On CUDA the model is initialised on the GPU from the CUDA RNG tracker
(``model_parallel_cuda_manual_seed``), bf16 is wrapped in ``Float16Module`` and the attention
builds its own causal mask, as in a training job. Without Transformer-Engine, Megatron-Core
(0.16.x) leaves ``moe_utils.te_general_gemm`` undefined, which the MoE router reads: ``patches()``
sets it to None on any device. On CPU it assumes CUDA in three more spots even with
``use_cpu_initialization``, which ``patches()`` covers while the model is built and run:
``torch.cuda.current_device()`` serves as a device (rotary table, router weights, MoE counters),
attention enters the CUDA RNG tracker's ``fork()``, and the default causal mask is built on
"cuda" (``logits`` passes an explicit one)."""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", module="megatron")


@contextlib.contextmanager
def patches(device: torch.device | str = "cpu"):
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # no Transformer-Engine: the router's plain matmul
    if torch.device(device).type == "cuda":
        yield
        return
    saved_dev, saved_fork = torch.cuda.current_device, mc_random.CudaRNGStatesTracker.fork
    torch.cuda.current_device = lambda: "cpu"
    mc_random.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device, mc_random.CudaRNGStatesTracker.fork = saved_dev, saved_fork


def _rope_theta(cfg: dict) -> float:
    return float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def transformer_config(cfg: dict, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """Megatron-Core's TransformerConfig of an HF config dict (this process's TP / EP sizes). On
    CUDA: initialised on the GPU, fusions as Megatron-Core's defaults leave them; on CPU:
    initialised on the CPU, every fusion off."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    heads = cfg["num_attention_heads"]
    kw = dict(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["intermediate_size"],
              num_attention_heads=heads, num_query_groups=cfg.get("num_key_value_heads", heads),
              kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads, normalization="RMSNorm",
              layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6), qk_layernorm=cfg["architectures"][0].startswith("Qwen3"),
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
              attention_dropout=0.0, hidden_dropout=0.0, init_method_std=cfg.get("initializer_range", 0.02),
              params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
              tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    if torch.device(device).type == "cpu":
        kw.update(use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False,
                  masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    if cfg.get("num_experts"):
        kw.update(num_moe_experts=cfg["num_experts"], moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                  moe_router_topk=cfg["num_experts_per_tok"], moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", moe_router_pre_softmax=False,
                  expert_model_parallel_size=ps.get_expert_model_parallel_world_size())
    return TransformerConfig(**kw)


def build_gpt(cfg: dict, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """This rank's shard of the GPTModel of ``cfg`` (parallel_state initialised), seeded, on
    ``device``; bf16 / fp16 in Megatron-Core's ``Float16Module`` (half inputs, float32 logits).
    On CPU, with one seed every TP size's shards are slices of the same full tensors. Norm
    weights are drawn away from 1 (the same on every rank) so that a mis-mapped norm shows."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    experts = cfg.get("num_experts") or None
    spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=cfg["architectures"][0].startswith("Qwen3"),
                                    normalization="RMSNorm")
    config = transformer_config(cfg, dtype, device)
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    with patches(device):
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg["vocab_size"],
                         max_sequence_length=cfg.get("max_position_embeddings", 4096), position_embedding_type="rope",
                         rotary_base=int(_rope_theta(cfg)),
                         share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings")), parallel_output=False)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(("layernorm.weight", "layer_norm_weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    model = model.to(device)
    if config.bf16 or config.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def logits(model, ids: list[int]) -> torch.Tensor:
    """Full-vocabulary float32 logits [len(ids), vocab] of one sequence (with autograd when enabled)."""
    device = next(model.parameters()).device
    t = torch.tensor([ids], device=device)
    pos = torch.arange(len(ids), device=device).unsqueeze(0)
    mask = None  # on CUDA: the causal mask the attention builds, as in training
    if device.type == "cpu":
        mask = torch.triu(torch.ones(1, 1, len(ids), len(ids), dtype=torch.bool, device=device), diagonal=1)
    with patches(device):
        return model(t, pos, mask)[0].float()
