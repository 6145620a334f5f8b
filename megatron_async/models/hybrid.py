"""Hybrid Mamba2 + attention decoders (NemotronH, Bamba, Mamba2) as block stacks.

A NemotronH / Mamba2 HF layer is one block (Mamba2, attention or MLP mixer); a Bamba HF layer
is two (its Mamba or attention mixer, then its SwiGLU MLP). Mamba blocks use
``batch.conv_states[i]`` / ``batch.ssm_states[i]`` and attention blocks ``batch.kv_caches[j]``,
numbered in layer order."""
from __future__ import annotations

import torch

from megatron_async.models.decoder import BlockSpec, DecoderModel, DecoderSpec
from megatron_async.models.hybrid_config import HybridConfig, HybridFamily, LayerKind, parse_hybrid_config
from megatron_async.models.quantization import Fp8Config
from megatron_async.parallel.state import ParallelState


def _blocks(cfg: HybridConfig) -> tuple[BlockSpec, ...]:
    if cfg.family == HybridFamily.BAMBA:
        blocks = []
        for i, kind in enumerate(cfg.layers):
            mixer = "mamba" if kind == LayerKind.MAMBA else "self_attn"
            blocks.append(BlockSpec(kind, f"model.layers.{i}.input_layernorm", f"model.layers.{i}.{mixer}"))
            blocks.append(BlockSpec(LayerKind.MLP, f"model.layers.{i}.pre_ff_layernorm", f"model.layers.{i}.feed_forward"))
        return tuple(blocks)
    # NemotronH (as transformers saves it) and Mamba2 name their body "backbone".
    return tuple(BlockSpec(kind, f"backbone.layers.{i}.norm", f"backbone.layers.{i}.mixer")
                 for i, kind in enumerate(cfg.layers))


def hybrid_spec(cfg: HybridConfig) -> DecoderSpec:
    bamba = cfg.family == HybridFamily.BAMBA
    return DecoderSpec(
        name=cfg.family.value, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, blocks=_blocks(cfg),
        attention=cfg.attention, mamba=cfg.mamba, mlp=cfg.mlp, norm_eps=cfg.norm_eps,
        nemotron_norm=cfg.family == HybridFamily.NEMOTRON_H, tie_word_embeddings=cfg.tie_word_embeddings,
        residual_in_fp32=cfg.residual_in_fp32, eos_token_id=cfg.eos_token_id,
        max_position_embeddings=cfg.max_position_embeddings,
        hf_embedding="model.embed_tokens" if bamba else "backbone.embeddings",
        hf_final_norm="model.final_layernorm" if bamba else "backbone.norm_f",
        # multi-token-prediction heads some NemotronH checkpoints carry; transformers ignores them
        hf_ignored_prefixes=("mtp.",), moe=cfg.moe,
    )


class HybridModel(DecoderModel):
    def __init__(self, cfg: HybridConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device | str,
                 quant: Fp8Config | None = None):
        super().__init__(hybrid_spec(cfg), parallel, dtype, device, quant)
        self.config = cfg

    def canonical_name(self, name: str) -> str:
        family = self.config.family
        if family == HybridFamily.NEMOTRON_H and name.startswith("model."):
            return "backbone." + name[len("model."):]  # transformers loads either prefix
        if family == HybridFamily.MAMBA2 and name == "backbone.embedding.weight":
            return "backbone.embeddings.weight"  # original mamba_ssm name
        return name


def build_hybrid(hf_config: dict, dtype: torch.dtype, device: torch.device | str,
                 parallel: ParallelState | None = None, quant: Fp8Config | None = None) -> HybridModel:
    """A HybridModel (this rank's shard) with uninitialised weights (fill them with ``load_hf_weights``);
    ``quant``: its FP8 linears."""
    return HybridModel(parse_hybrid_config(hf_config), parallel or ParallelState(), dtype, device, quant)
