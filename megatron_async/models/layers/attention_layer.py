"""Self-attention of a GPT layer: fused qkv projection, optional q/k norm, RoPE, paged attention."""
from __future__ import annotations

import torch
from torch import nn

from megatron_async.inference.contexts.metadata import AttentionMetadata
from megatron_async.kernels import fused_ops
from megatron_async.kernels.attention import attend
from megatron_async.models.layers.norm import RMSNorm
from megatron_async.models.layers.rope import apply_rotary
from megatron_async.models.model_config import GPTConfig
from megatron_async.models.weight_loading import Target
from megatron_async.parallel.layers import column_parallel_linear, divide, row_parallel_linear, shard_target
from megatron_async.parallel.state import tp_size


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        # Tensor parallelism: each rank owns whole query and KV heads (qkv column-parallel,
        # o_proj row-parallel); the counts below are this rank's.
        tp = tp_size()
        self.num_heads = divide(cfg.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(cfg.num_key_value_heads, tp, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        kw = dict(dtype=dtype, device=device)
        qkv_rows = self.q_size + 2 * self.kv_size
        # rows: [q | k | v], so one matmul produces all three
        self.qkv_weight = nn.Parameter(torch.empty(qkv_rows, cfg.hidden_size, **kw), requires_grad=False)
        self.qkv_bias = nn.Parameter(torch.empty(qkv_rows, **kw), requires_grad=False) if cfg.qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(cfg.hidden_size, self.q_size, **kw), requires_grad=False)
        self.o_bias = nn.Parameter(torch.empty(cfg.hidden_size, **kw), requires_grad=False) if cfg.o_bias else None
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None

    def hf_targets(self, prefix: str) -> dict[str, Target]:
        """HF tensor name -> the slice of our parameter it fills (and, under TP, the rank's
        share of the HF tensor: q, k and v are each cut separately)."""
        q, kv, tp = self.q_size, self.kv_size, tp_size()
        spans = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        targets = {f"{prefix}.{n}.weight": shard_target(self.qkv_weight.data[a:b], 0, (b - a) * tp)
                   for n, (a, b) in spans.items()}
        if self.qkv_bias is not None:
            targets.update({f"{prefix}.{n}.bias": shard_target(self.qkv_bias.data[a:b], 0, (b - a) * tp)
                            for n, (a, b) in spans.items()})
        targets[f"{prefix}.o_proj.weight"] = shard_target(self.o_weight.data, 1, q * tp)
        if self.o_bias is not None:
            targets[f"{prefix}.o_proj.bias"] = self.o_bias.data
        if self.q_norm is not None:
            targets[f"{prefix}.q_norm.weight"] = self.q_norm.weight.data
            targets[f"{prefix}.k_norm.weight"] = self.k_norm.weight.data
        return targets

    def _qk_norm_args(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        if self.q_norm is None:
            return None, None, 0.0
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = column_parallel_linear(x, self.qkv_weight, self.qkv_bias, batch_invariant)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if batch_invariant or fused_ops.use_fused(q):  # q/k norm and rope of q and k in one kernel (per token)
            q, k = fused_ops.rope_qk(q, k, cos, sin, *self._qk_norm_args())
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(q, k, v, kv_cache, meta, self.scale, batch_invariant)
        return row_parallel_linear(out.reshape(T, self.q_size), self.o_weight, self.o_bias, batch_invariant)
