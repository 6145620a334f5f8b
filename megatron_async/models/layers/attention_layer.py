"""Self-attention mixer of GPT and hybrid models: fused qkv projection (column-parallel by
heads), optional per-head q/k norm, RoPE on the first ``rotary_dim`` dims of each head (none
when 0), paged attention over this rank's heads, row-parallel output projection (an FP8 one may get its input quantized by the attention kernel).

``kv_scale`` [2, KV heads of this rank] float32 (keys, values): the scales of an e4m3 KV cache
(``kernels/kv_cache_fp8.py``), powers of two, 1.0 (values beyond +-448 saturate). A buffer, not
a checkpoint tensor: read only when the cache is e4m3."""
from __future__ import annotations

import torch
from torch import nn

from megatron_async.config import AttentionBackend
from megatron_async.kernels import fused_ops
from megatron_async.kernels.attention import attend
from megatron_async.models.layers.block import StepInputs
from megatron_async.models.layers.norm import RMSNorm
from megatron_async.models.layers.rope import apply_rotary
from megatron_async.models.model_config import AttentionConfig
from megatron_async.models.quantization import NO_QUANT, QuantScope
from megatron_async.parallel.linear import QKVParallelLinear, RowParallelLinear
from megatron_async.parallel.state import ParallelState


class Attention(nn.Module):
    def __init__(self, hidden: int, cfg: AttentionConfig, kv_index: int, parallel: ParallelState,
                 dtype: torch.dtype, device: torch.device | str, quant: QuantScope = NO_QUANT):
        """``kv_index``: this layer's KV cache among the model's attention layers; ``quant``: which
        of its projections are FP8."""
        super().__init__()
        self.cfg, self.kv_index = cfg, kv_index
        self.qkv_proj = QKVParallelLinear(hidden, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias,
                                          parallel, dtype, device, quant.fp8("q_proj", "k_proj", "v_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, hidden, cfg.o_bias, parallel, dtype, device,
                                        "num_attention_heads * head_dim", quant.fp8("o_proj"))
        has_norm = cfg.qk_norm_eps is not None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps, dtype, device) if has_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps, dtype, device) if has_norm else None
        self.register_buffer("kv_scale", torch.ones(2, self.num_kv_heads, dtype=torch.float32, device=device),
                             persistent=False)

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.cfg.rotary_dim
        if r == self.head_dim:
            return apply_rotary(t, cos, sin)
        return torch.cat([apply_rotary(t[..., :r], cos, sin), t[..., r:]], dim=-1)

    @property
    def fp8_input_linear(self) -> QKVParallelLinear | None:
        """The FP8 linear that alone reads this mixer's input (its norm may hand it quantized rows)."""
        return self.qkv_proj if self.qkv_proj.weight_scale_inv is not None else None

    def forward(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """x: [T, hidden], or its rows quantized for the FP8 qkv projection (``fp8_input_linear``)."""
        T = x.shape[0]
        inv, kernels, lora = step.batch.batch_invariant, step.kernels, step.batch.lora_rows
        fused_rope = step.rope is not None and (inv or fused_ops.use_fused(x, kernels.fused))
        # a TP rank at decode sizes: K-split partials, which the rope kernel sums (no reduce kernel)
        parts = self.qkv_proj.tp_split(x, kernels.split_k) if fused_rope and not inv and lora is None else None
        qkv = self.qkv_proj(x, inv, lora) if parts is None else parts.parts[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        kv_cache = step.batch.kv_caches[self.kv_index]
        if fused_rope:  # q/k norm + rope of q and k, per token
            norm = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            split = {} if parts is None else dict(splits=parts.parts.shape[0], split_stride=parts.parts.stride(0))
            # the same kernel stores k and v in the paged cache (attend then skips its append)
            q, k = fused_ops.rope_qk(q, k, *step.rope, *norm, v=v, kv_cache=kv_cache,
                                     slot_mapping=step.batch.attn.slot_mapping, kv_scale=self.kv_scale, **split)
            v = None
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q, inv, kernels.fused), self.k_norm(k, inv, kernels.fused)
            if step.rope is not None:
                q, k = self._rotate(q, *step.rope), self._rotate(k, *step.rope)
        # a step whose long rows run FA3 hands an FP8 o_proj its output unquantized (o_proj quantizes it itself)
        fa3_step = kernels.flashinfer_prefill and step.batch.attn.long_tiles and kv_cache.dtype == q.dtype
        quantize = not inv and lora is None and not fa3_step and self._quantizes_output(T, q, kernels)
        out = attend(q, k, v, kv_cache, step.batch.attn, self.head_dim**-0.5, inv, kernels.attention, self.kv_scale,
                     quantize, kernels.flashinfer_prefill)
        return self.o_proj(out.reshape(T, self.q_size) if isinstance(out, torch.Tensor) else out, inv, kernels.split_k,
                           lora)

    def _quantizes_output(self, rows: int, q: torch.Tensor, kernels) -> bool:
        """Whether the attention kernel hands an FP8 o projection its ``rows`` quantized (Triton
        kernels, head_dim 128: one 128-wide group a head), where that linear would quantize them
        in a pass of its own."""
        return (kernels.attention == AttentionBackend.TRITON and self.head_dim == 128
                and fused_ops.fp8_input_prequantized(rows, q.dtype, q.device, self.o_proj, kernels.fused))
