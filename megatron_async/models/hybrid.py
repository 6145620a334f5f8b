"""Hybrid Mamba2 + attention decoders (NemotronH, Bamba, Mamba2) running packed steps.

The model is a flat list of pre-norm residual blocks, each ``h += mixer(norm(h))`` with
one mixer: Mamba2, attention, or an MLP. A NemotronH / Mamba2 HF layer is one block; a
Bamba HF layer is two (its Mamba or attention mixer, then its SwiGLU MLP). Mamba blocks
use ``batch.conv_states[i]`` / ``batch.ssm_states[i]`` and attention blocks
``batch.kv_caches[j]``, numbered in layer order."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_async.inference.contexts.metadata import ForwardBatch
from megatron_async.kernels import fused_ops
from megatron_async.kernels.attention import attend
from megatron_async.kernels.linear import linear
from megatron_async.models.base import CausalLM, KVCacheSpec, MambaStateSpec
from megatron_async.models.hybrid_config import (
    AttentionConfig,
    HybridConfig,
    HybridFamily,
    LayerKind,
    MLPConfig,
    parse_hybrid_config,
)
from megatron_async.models.layers.mamba2_mixer import Mamba2Mixer, MambaStepPlan
from megatron_async.models.layers.mlp import SwiGLUMLP
from megatron_async.models.layers.norm import RMSNorm
from megatron_async.models.layers.rope import RotaryEmbedding, apply_rotary
from megatron_async.models.weight_loading import copy_hf_weights

# Tensors that some checkpoints carry and transformers ignores: multi-token-prediction heads
# (NemotronH "mtp.*") and recomputed rotary buffers.
_IGNORED_PREFIXES = ("mtp.",)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class NemotronRMSNorm(RMSNorm):
    """NemotronH scales in float32 before casting back (LlamaRMSNorm casts first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.use_fused(x) and x.dtype == self.weight.dtype:
            return fused_ops.rms_norm(x, self.weight, self.eps, cast_before_weight=False)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class ReluSquaredMLP(nn.Module):
    """NemotronH's non-gated MLP: down(relu(up(x))^2)."""

    def __init__(self, hidden: int, cfg: MLPConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.up_weight = nn.Parameter(torch.empty(cfg.intermediate_size, hidden, **kw), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(hidden, cfg.intermediate_size, **kw), requires_grad=False)
        self.up_bias = nn.Parameter(torch.empty(cfg.intermediate_size, **kw), requires_grad=False) if cfg.bias else None
        self.down_bias = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False) if cfg.bias else None

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        names = {"up_proj.weight": self.up_weight, "up_proj.bias": self.up_bias,
                 "down_proj.weight": self.down_weight, "down_proj.bias": self.down_bias}
        return {f"{prefix}.{k}": v.data for k, v in names.items() if v is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = F.linear(x, self.up_weight, self.up_bias)
        return F.linear(torch.relu(up).square(), self.down_weight, self.down_bias)


class HybridAttention(nn.Module):
    """Fused qkv projection, RoPE on the first ``rotary_dim`` dims of each head (none when 0),
    paged attention."""

    def __init__(self, hidden: int, cfg: AttentionConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.cfg = cfg
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        rows = self.q_size + 2 * self.kv_size
        kw = dict(dtype=dtype, device=device)
        self.qkv_weight = nn.Parameter(torch.empty(rows, hidden, **kw), requires_grad=False)
        self.qkv_bias = nn.Parameter(torch.empty(rows, **kw), requires_grad=False) if cfg.qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(hidden, self.q_size, **kw), requires_grad=False)
        self.o_bias = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False) if cfg.o_bias else None

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        q, kv = self.q_size, self.kv_size
        spans = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        targets = {f"{prefix}.{n}.weight": self.qkv_weight.data[a:b] for n, (a, b) in spans.items()}
        if self.qkv_bias is not None:
            targets.update({f"{prefix}.{n}.bias": self.qkv_bias.data[a:b] for n, (a, b) in spans.items()})
        targets[f"{prefix}.o_proj.weight"] = self.o_weight.data
        if self.o_bias is not None:
            targets[f"{prefix}.o_proj.bias"] = self.o_bias.data
        return targets

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.cfg.rotary_dim
        if r == self.cfg.head_dim:
            return apply_rotary(t, cos, sin)
        return torch.cat([apply_rotary(t[..., :r], cos, sin), t[..., r:]], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        T, c = x.shape[0], self.cfg
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, c.num_heads, c.head_dim)
        k, v = k.view(T, c.num_kv_heads, c.head_dim), v.view(T, c.num_kv_heads, c.head_dim)
        if rope is not None:
            if fused_ops.use_fused(q):  # one kernel for q and k (partial rotary included)
                q, k = fused_ops.rope_qk(q, k, *rope)
            else:
                q, k = self._rotate(q, *rope), self._rotate(k, *rope)
        out = attend(q, k, v, kv_cache, batch.attn, c.head_dim**-0.5)
        return F.linear(out.reshape(T, self.q_size), self.o_weight, self.o_bias)


class HybridBlock(nn.Module):
    """h + mixer(norm(h)); ``state_index`` numbers the block among blocks of its kind."""

    def __init__(
        self, kind: LayerKind, cfg: HybridConfig, state_index: int, dtype: torch.dtype, device: torch.device | str
    ):
        super().__init__()
        self.kind, self.state_index = kind, state_index
        norm_cls = NemotronRMSNorm if cfg.family == HybridFamily.NEMOTRON_H else RMSNorm
        self.norm = norm_cls(cfg.hidden_size, cfg.norm_eps, dtype, device)
        if kind == LayerKind.MAMBA:
            self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba, dtype, device)
        elif kind == LayerKind.ATTENTION:
            self.mixer = HybridAttention(cfg.hidden_size, cfg.attention, dtype, device)
        elif cfg.mlp.gated:
            self.mixer = SwiGLUMLP(cfg.hidden_size, cfg.mlp.intermediate_size, cfg.mlp.bias, dtype, device)
        else:
            self.mixer = ReluSquaredMLP(cfg.hidden_size, cfg.mlp, dtype, device)

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        plan: MambaStepPlan | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        x = self.norm(h.to(self.norm.weight.dtype))
        if self.kind == LayerKind.MAMBA:
            out = self.mixer(x, batch.conv_states[self.state_index], batch.ssm_states[self.state_index], plan)
        elif self.kind == LayerKind.ATTENTION:
            out = self.mixer(x, rope, batch.kv_caches[self.state_index], batch)
        else:
            out = self.mixer(x)
        return h + out


def _hf_block_names(cfg: HybridConfig) -> tuple[str, list[tuple[LayerKind, str, str]]]:
    """(HF prefix of the model body, [(kind, HF norm name, HF mixer name)] per block)."""
    if cfg.family == HybridFamily.BAMBA:
        blocks = []
        for i, kind in enumerate(cfg.layers):
            mixer = "mamba" if kind == LayerKind.MAMBA else "self_attn"
            blocks.append((kind, f"model.layers.{i}.input_layernorm", f"model.layers.{i}.{mixer}"))
            blocks.append((LayerKind.MLP, f"model.layers.{i}.pre_ff_layernorm", f"model.layers.{i}.feed_forward"))
        return "model", blocks
    # NemotronH (as transformers saves it) and Mamba2 name their body "backbone".
    return "backbone", [
        (kind, f"backbone.layers.{i}.norm", f"backbone.layers.{i}.mixer") for i, kind in enumerate(cfg.layers)
    ]


class HybridModel(CausalLM):
    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.max_position_embeddings = cfg.max_position_embeddings
        self.dtype = dtype
        kw = dict(dtype=dtype, device=device)
        self.embed_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False)
        self._hf_body, names = _hf_block_names(cfg)
        counts = {LayerKind.MAMBA: 0, LayerKind.ATTENTION: 0, LayerKind.MLP: 0}
        blocks = []
        for kind, _, _ in names:
            blocks.append(HybridBlock(kind, cfg, counts[kind], dtype, device))
            counts[kind] += 1
        self.blocks = nn.ModuleList(blocks)
        self._hf_names = [(norm, mixer) for _, norm, mixer in names]
        norm_cls = NemotronRMSNorm if cfg.family == HybridFamily.NEMOTRON_H else RMSNorm
        self.final_norm = norm_cls(cfg.hidden_size, cfg.norm_eps, dtype, device)
        self.lm_head_weight = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False)
        )
        att = cfg.attention
        self.rope = (
            RotaryEmbedding(att.rotary_dim, cfg.max_position_embeddings, att.rope_theta, None, dtype, device)
            if att is not None and att.rotary_dim > 0
            else None
        )

    def reserve_positions(self, num_positions: int) -> None:
        if self.rope is not None:
            self.rope.reserve(num_positions)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = input_ids.shape[0]
        rope = None
        if self.rope is not None:
            self.rope.reserve(batch.attn.max_kv_len)  # host int: no device sync
            rope = self.rope(batch.attn.positions[:T])
        plan = MambaStepPlan.build(batch.mamba) if self.config.num_mamba_layers else None
        h = F.embedding(input_ids, self.embed_weight)
        if self.config.residual_in_fp32:
            h = h.float()
        for block in self.blocks:
            h = block(h, batch, plan, rope)
        return self.final_norm(h.to(self.dtype))

    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        weight = self.embed_weight if self.lm_head_weight is None else self.lm_head_weight
        return linear(hidden, weight, None, batch_invariant).float()

    def kv_cache_spec(self) -> KVCacheSpec:
        att = self.config.attention
        if att is None:  # pure Mamba2: no KV cache; head dims only keep size arithmetic well-defined
            return KVCacheSpec(0, 1, self.config.mamba.head_dim)
        return KVCacheSpec(self.config.num_attention_layers, att.num_kv_heads, att.head_dim)

    def mamba_state_spec(self) -> MambaStateSpec:
        m = self.config.mamba
        return MambaStateSpec(
            num_layers=self.config.num_mamba_layers,
            conv_shape=(m.conv_dim, m.conv_kernel - 1),
            ssm_shape=(m.num_heads, m.head_dim, m.d_state),
        )

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """Every HF tensor name this model needs -> the (slice of a) parameter it fills."""
        body = self._hf_body
        bamba = self.config.family == HybridFamily.BAMBA
        embed, final = ("embed_tokens", "final_layernorm") if bamba else ("embeddings", "norm_f")
        targets = {
            f"{body}.{embed}.weight": self.embed_weight.data,
            f"{body}.{final}.weight": self.final_norm.weight.data,
        }
        for block, (norm, mixer) in zip(self.blocks, self._hf_names):
            targets[f"{norm}.weight"] = block.norm.weight.data
            targets.update(block.mixer.hf_targets(mixer))
        if self.lm_head_weight is not None:
            targets["lm_head.weight"] = self.lm_head_weight.data
        return targets

    def _canonical_name(self, name: str) -> str:
        """Map accepted spellings onto the names transformers saves."""
        family = self.config.family
        if family == HybridFamily.NEMOTRON_H and name.startswith("model."):
            return "backbone." + name[len("model."):]  # transformers loads either prefix
        if family == HybridFamily.MAMBA2 and name == "backbone.embedding.weight":
            return "backbone.embeddings.weight"  # original mamba_ssm name
        return name

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.lm_head_weight is None
        # some tied checkpoints also store the (identical) head: skip it
        skip = lambda name: (  # noqa: E731
            name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")
        )
        copy_hf_weights(self.hf_targets(), weights, skip, self._canonical_name, what=self.config.family.value)


def build_hybrid(hf_config: dict, dtype: torch.dtype, device: torch.device | str) -> HybridModel:
    """A HybridModel with uninitialised weights (fill them with ``load_hf_weights``)."""
    return HybridModel(parse_hybrid_config(hf_config), dtype, device)
