"""GPT decoder (Llama / Qwen2 / Qwen3) running packed steps over the paged KV cache."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from megatron_async.inference.contexts.metadata import ForwardBatch
from megatron_async.models.base import CausalLM, KVCacheSpec
from megatron_async.models.layers.attention_layer import SelfAttention
from megatron_async.models.layers.mlp import SwiGLUMLP
from megatron_async.models.layers.norm import RMSNorm
from megatron_async.models.layers.rope import RotaryEmbedding
from megatron_async.models.model_config import GPTConfig, parse_gpt_config
from megatron_async.models.weight_loading import Target, copy_hf_weights
from megatron_async.parallel.layers import divide, parallel_lm_head, shard_target, vocab_parallel_embedding
from megatron_async.parallel.state import tp_size

# Buffers some old checkpoints saved; they are recomputed here, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)



class DecoderLayer(nn.Module):
    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = SelfAttention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device)

    def hf_targets(self, prefix: str) -> dict[str, Target]:
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
        inv = batch.batch_invariant
        if residual is None:
            h, residual = self.input_layernorm(x, inv), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual, inv)
        attn_out = self.self_attn(h, cos, sin, kv_cache, batch.attn, inv)
        h, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual, inv)
        return self.mlp(h, inv), residual


class GPTModel(CausalLM):
    supports_batch_invariant = True

    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.max_position_embeddings = cfg.max_position_embeddings
        # Tensor parallelism: embedding and LM head are split along the vocabulary; the
        # layers split heads and MLP columns. tp_size 1 is the unsharded model.
        self.tensor_parallel_size = tp_size()
        local_vocab = divide(cfg.vocab_size, self.tensor_parallel_size, "vocab_size")
        kw = dict(dtype=dtype, device=device)
        self.embed_weight = nn.Parameter(torch.empty(local_vocab, cfg.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head_weight = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(local_vocab, cfg.hidden_size, **kw), requires_grad=False)
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
        x, residual = vocab_parallel_embedding(input_ids, self.embed_weight), None
        for layer, kv_cache in zip(self.layers, batch.kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, batch)
        inv = batch.batch_invariant
        return self.norm(x, inv) if residual is None else self.norm.add_and_norm(x, residual, inv)[0]

    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        weight = self.embed_weight if self.lm_head_weight is None else self.lm_head_weight
        # matmul in the model dtype (as HF does), then float32 full-vocab logits on every rank
        return parallel_lm_head(hidden, weight, batch_invariant)

    def kv_cache_spec(self) -> KVCacheSpec:
        # this rank's KV heads: the context allocates only the local share of the cache
        local_kv_heads = self.config.num_key_value_heads // self.tensor_parallel_size
        return KVCacheSpec(self.config.num_hidden_layers, local_kv_heads, self.config.head_dim)

    def hf_targets(self) -> dict[str, Target]:
        """Every HF tensor name this model needs -> the (slice of a) parameter it fills."""
        vocab = self.config.vocab_size
        targets = {"model.embed_tokens.weight": shard_target(self.embed_weight.data, 0, vocab),
                   "model.norm.weight": self.norm.weight.data}
        for i, layer in enumerate(self.layers):
            targets.update(layer.hf_targets(f"model.layers.{i}"))
        if self.lm_head_weight is not None:
            targets["lm_head.weight"] = shard_target(self.lm_head_weight.data, 0, vocab)
        return targets

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.lm_head_weight is None
        # some tied checkpoints also store the (identical) head: skip it
        skip = lambda name: name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")  # noqa: E731
        copy_hf_weights(self.hf_targets(), weights, skip, what=self.config.architecture)

def build_gpt(hf_config: dict, dtype: torch.dtype, device: torch.device | str) -> GPTModel:
    """A GPTModel with uninitialised weights (fill them with ``load_hf_weights``)."""
    return GPTModel(parse_gpt_config(hf_config), dtype, device)
