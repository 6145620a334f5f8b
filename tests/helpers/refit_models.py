"""Tiny engine models for the refit tests (no transformers needed) and a trainer's Megatron-Core
shards of their weights, built from full HF tensors through the name tables' reverse."""
from __future__ import annotations

import torch

from megatron_async.models.default_model import random_hf_tensors
from megatron_async.models.gpt import build_gpt
from megatron_async.models.hybrid import build_hybrid
from megatron_async.models.megatron_layouts import NameMap, Shard, megatron_from_hf, megatron_names_of
from megatron_async.parallel.state import ParallelState

_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=128, hidden_size=64,
              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32")
CONFIGS: dict[str, dict] = {
    "dense": _QWEN3,
    "dense_tp4": {**_QWEN3, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8},
    "qwen2": {**_QWEN3, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "head_dim": None},
    "moe": {**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "moe_intermediate_size": 32,
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1]},
    "hybrid": dict(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", vocab_size=128, hidden_size=32,
                   hybrid_override_pattern="M*M-", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=64, mamba_num_heads=4, mamba_head_dim=12, ssm_state_size=8, n_groups=2,
                   conv_kernel=4, chunk_size=4, layer_norm_epsilon=1e-5, dtype="float32"),
}


def build(kind: str, tp: int = 1, rank: int = 0, ep: int = 1, ep_rank: int = 0, dtype=torch.float32):
    """An engine model of ``kind`` (CONFIGS) as rank (``rank``, ``ep_rank``) of TP ``tp`` x EP ``ep``,
    its weights zero."""
    cfg = {k: v for k, v in CONFIGS[kind].items() if v is not None}
    parallel = ParallelState(tp_rank=rank, tp_size=tp, ep_rank=ep_rank, ep_size=ep)
    builder = build_hybrid if kind == "hybrid" else build_gpt
    model = builder(cfg, dtype, "cpu", parallel)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def hf_weights(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random full HF tensors of ``kind`` (every one distinct, so a mis-mapped tensor shows)."""
    shapes = build(kind).hf_shapes()
    return dict(random_hf_tensors(shapes, torch.float32, torch.device("cpu"), 0.5, seed))


def load_full(model, hf: dict[str, torch.Tensor]):
    model.load_hf_weights(hf.items())
    return model


def trainer_shards(kind: str, hf: dict[str, torch.Tensor], tp: int, ep: int = 1,
                   padded_vocab: int | None = None) -> list[list[tuple[str, torch.Tensor, Shard]]]:
    """Each trainer rank's (Megatron name, shard, Shard) triples for Megatron TP ``tp`` x EP ``ep``
    (expert TP = TP), every rank's copy of replicated tensors included."""
    model = build(kind)
    names = NameMap.for_arch(model.spec.name)
    dims = model.megatron_dims()
    out = []
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            shard = Shard(tp_rank=tp_rank, tp_size=tp, ep_rank=ep_rank, ep_size=ep)
            mnames = megatron_names_of(names, hf, dims, shard)
            tensors = megatron_from_hf(names, dims, hf, mnames, shard, padded_vocab)
            out.append([(n, t, shard) for n, t in tensors.items()])
    return out


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
