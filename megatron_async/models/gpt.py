"""GPT decoder (Llama / Qwen2 / Qwen3) running packed steps over the paged KV cache."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_async.inference.contexts.metadata import ForwardBatch
from megatron_async.models.base import CausalLM, KVCacheSpec
from megatron_async.models.layers.attention_layer import SelfAttention
from megatron_async.models.layers.mlp import SwiGLUMLP
from megatron_async.models.layers.norm import RMSNorm
from megatron_async.models.layers.rope import RotaryEmbedding
from megatron_async.models.model_config import GPTConfig, parse_gpt_config
from megatron_async.models.weight_loading import copy_hf_weights

# Buffers some old checkpoints saved; they are recomputed here, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)



class DecoderLayer(nn.Module):
    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = SelfAttention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device)

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.input_layernorm.weight": self.input_layernorm.weight.data,
            f"{prefix}.post_attention_layernorm.weight": self.post_attention_layernorm.weight.data,
            **self.self_attn.hf_targets(f"{prefix}.self_attn"),
            **self.mlp.hf_targets(f"{prefix}.mlp"),
        }

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, or the embeddings when ``residual`` is None.
        Returns (this layer's MLP output, residual stream before it). Each residual add is
        fused with the norm after it; the sums round as ``h = h + f(norm(h))`` does."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn_out = self.self_attn(h, cos, sin, kv_cache, batch.attn)
        h, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(h), residual


class GPTModel(CausalLM):
    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.max_position_embeddings = cfg.max_position_embeddings
        kw = dict(dtype=dtype, device=device)
        self.embed_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head_weight = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False)
        )
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype, device
        )

    def reserve_positions(self, num_positions: int) -> None:
        """Pre-size the rope table (e.g. to max_sequence_length before CUDA-graph capture)."""
        self.rope.reserve(num_positions)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # max_kv_len is a host int, so growing the rope table never syncs with the device.
        self.rope.reserve(batch.attn.max_kv_len)
        cos, sin = self.rope(batch.attn.positions[: input_ids.shape[0]])
        x, residual = F.embedding(input_ids, self.embed_weight), None
        for layer, kv_cache in zip(self.layers, batch.kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, batch)
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_weight if self.lm_head_weight is None else self.lm_head_weight
        # matmul in the model dtype (as HF does), then float32 for sampling
        return F.linear(hidden, weight).float()

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.config.num_hidden_layers, self.config.num_key_value_heads, self.config.head_dim)

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """Every HF tensor name this model needs -> the (slice of a) parameter it fills."""
        targets = {"model.embed_tokens.weight": self.embed_weight.data, "model.norm.weight": self.norm.weight.data}
        for i, layer in enumerate(self.layers):
            targets.update(layer.hf_targets(f"model.layers.{i}"))
        if self.lm_head_weight is not None:
            targets["lm_head.weight"] = self.lm_head_weight.data
        return targets

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.lm_head_weight is None
        # some tied checkpoints also store the (identical) head: skip it
        skip = lambda name: name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")  # noqa: E731
        copy_hf_weights(self.hf_targets(), weights, skip, what=self.config.architecture)

def build_gpt(hf_config: dict, dtype: torch.dtype, device: torch.device | str) -> GPTModel:
    """A GPTModel with uninitialised weights (fill them with ``load_hf_weights``)."""
    return GPTModel(parse_gpt_config(hf_config), dtype, device)
