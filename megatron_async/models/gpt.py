"""GPT decoders (Llama / Qwen2 / Qwen3, Qwen3-MoE, Mixtral): per HF layer, an attention block
and a SwiGLU block or (sparse layers) a mixture-of-experts block."""
from __future__ import annotations

import torch

from megatron_async.models.decoder import BlockSpec, DecoderModel, DecoderSpec
from megatron_async.models.model_config import GPTConfig, LayerKind, parse_gpt_config
from megatron_async.models.mtp_weights import mtp_depths
from megatron_async.models.quantization import Fp8Config
from megatron_async.parallel.state import ParallelState


def gpt_spec(cfg: GPTConfig, mtp_depths: int = 0) -> DecoderSpec:
    blocks = []
    for i in range(cfg.num_hidden_layers):
        layer = f"model.layers.{i}"
        blocks.append(BlockSpec(LayerKind.ATTENTION, f"{layer}.input_layernorm", f"{layer}.self_attn"))
        if cfg.sparse_layers and cfg.sparse_layers[i]:
            moe_name = "block_sparse_moe" if cfg.architecture == "MixtralForCausalLM" else "mlp"
            blocks.append(BlockSpec(LayerKind.MOE, f"{layer}.post_attention_layernorm", f"{layer}.{moe_name}"))
        else:
            blocks.append(BlockSpec(LayerKind.MLP, f"{layer}.post_attention_layernorm", f"{layer}.mlp"))
    return DecoderSpec(
        name=cfg.architecture, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, blocks=tuple(blocks),
        attention=cfg.attention(), mamba=None, mlp=cfg.mlp(), norm_eps=cfg.rms_norm_eps, nemotron_norm=False,
        tie_word_embeddings=cfg.tie_word_embeddings, residual_in_fp32=False, eos_token_id=cfg.eos_token_id,
        max_position_embeddings=cfg.max_position_embeddings, hf_embedding="model.embed_tokens",
        hf_final_norm="model.norm", moe=cfg.moe, mtp_depths=mtp_depths,
    )


class GPTModel(DecoderModel):
    def __init__(self, cfg: GPTConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device | str,
                 mtp_depths: int = 0, quant: Fp8Config | None = None):
        super().__init__(gpt_spec(cfg, mtp_depths), parallel, dtype, device, quant)
        self.config = cfg


def build_gpt(hf_config: dict, dtype: torch.dtype, device: torch.device | str,
              parallel: ParallelState | None = None, quant: Fp8Config | None = None) -> GPTModel:
    """A GPTModel (this rank's shard) with uninitialised weights (fill them with ``load_hf_weights``);
    ``quant``: its FP8 linears."""
    return GPTModel(parse_gpt_config(hf_config), parallel or ParallelState(), dtype, device, mtp_depths(hf_config),
                    quant)
