"""Typed view of a Hugging Face ``config.json`` for Llama / Qwen2 / Qwen3 decoders and their
mixture-of-experts variants (Qwen3-MoE, Mixtral: MoE fields in ``moe_config.py``).

Defaults follow the Hugging Face config classes of each family, so a checkpoint
that omits a field behaves here as it does in ``transformers``."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from megatron_async.models.config_fields import first_id, positive_int
from megatron_async.models.moe_config import MoEConfig, parse_softmax_moe

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
GPT_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", *MOE_ARCHITECTURES)
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
_DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "Qwen2ForCausalLM": 32768, "Qwen3ForCausalLM": 32768,
                          "Qwen3MoeForCausalLM": 32768, "MixtralForCausalLM": 4096 * 32}
_DEFAULT_RMS_EPS = {"MixtralForCausalLM": 1e-5}
_DEFAULT_INTERMEDIATE = {"Qwen3MoeForCausalLM": 6144, "MixtralForCausalLM": 14336}
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeScaling:
    """Parameters of a scaled rotary embedding (HF ``rope_type`` other than "default")."""

    rope_type: str
    """"linear", "dynamic", "llama3" or "yarn"."""
    factor: float
    original_max_position_embeddings: int | None = None
    """llama3 / yarn: context length the model was pretrained with."""
    low_freq_factor: float | None = None
    """llama3 only."""
    high_freq_factor: float | None = None
    """llama3 only."""
    attention_factor: float | None = None
    """yarn only: multiplier of cos/sin; None = derived from factor / mscale."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    """yarn: round the correction range to whole dimensions."""


class LayerKind(str, Enum):
    """Mixer of one HF layer; values are NemotronH ``hybrid_override_pattern`` characters."""

    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"
    MOE = "E"


@dataclass(frozen=True)
class AttentionConfig:
    """One self-attention mixer, shared by GPT and hybrid models (full model sizes: the layer
    takes this rank's heads)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    rotary_dim: int
    """Leading dims of each head that RoPE rotates; 0 = no rotary embedding (NemotronH)."""
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    qk_norm_eps: float | None = None
    """Per-head RMSNorm of q and k before RoPE (Qwen3) with this epsilon; None = none."""


@dataclass(frozen=True)
class MLPConfig:
    intermediate_size: int
    gated: bool
    """True: SwiGLU down(silu(gate(x)) * up(x)) (Llama, Qwen, Bamba); False: down(relu(up(x))^2) (NemotronH)."""
    bias: bool


@dataclass(frozen=True)
class GPTConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on q/k/v projections (Qwen2 always; Llama/Qwen3 via ``attention_bias``)."""
    o_bias: bool
    """Bias on the output projection (Llama/Qwen3 ``attention_bias``; never Qwen2)."""
    mlp_bias: bool
    qk_norm: bool
    """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
    eos_token_id: int | None
    torch_dtype: str | None
    moe: MoEConfig | None = None
    """The MoE mixer of sparse layers (Qwen3-MoE, Mixtral); None for dense models."""
    sparse_layers: tuple[bool, ...] = ()
    """Per layer: True = MoE mixer, False = dense SwiGLU MLP (empty for dense models)."""

    def attention(self) -> AttentionConfig:
        return AttentionConfig(
            self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.qkv_bias, self.o_bias,
            self.head_dim, self.rope_theta, self.rope_scaling, self.rms_norm_eps if self.qk_norm else None,
        )

    def mlp(self) -> MLPConfig:
        return MLPConfig(self.intermediate_size, gated=True, bias=self.mlp_bias)


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", ""))
    if arch is None:
        raise ValueError("config.json: neither 'architectures' nor a known 'model_type' is given")
    if arch not in GPT_ARCHITECTURES:
        raise ValueError(f"config.json: architecture {arch!r} is not a GPT decoder ({', '.join(GPT_ARCHITECTURES)})")
    return arch


def _rope(cfg: dict, max_positions: int, default_theta: float = _DEFAULT_ROPE_THETA) -> tuple[float, RopeScaling | None]:
    # transformers 5.x writes `rope_parameters` (theta inside); older configs write
    # `rope_theta` at top level and `rope_scaling` (with "type" or "rope_type").
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json: unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 is not supported for GPT models")
    if rope_type == "default":
        return theta, None

    # HF gives a top-level `original_max_position_embeddings` priority, else defaults it to
    # max_position_embeddings for the types that need it.
    original = cfg.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    if rope_type in ("llama3", "yarn") and original is None:
        original = max_positions
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_positions / original
    if factor is None:
        raise ValueError(f"config.json: rope_type {rope_type!r} needs a 'factor'")
    if rope_type == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if params.get(k) is None]
        if missing:
            raise ValueError(f"config.json: rope_type 'llama3' needs {', '.join(missing)}")
        if params["high_freq_factor"] <= params["low_freq_factor"]:
            raise ValueError("config.json: llama3 rope needs high_freq_factor > low_freq_factor")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=None if original is None else int(original),
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
        attention_factor=params.get("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def parse_gpt_config(cfg: dict) -> GPTConfig:
    """Validate a HF config dict of a Llama / Qwen2 / Qwen3 model; ValueError names the bad field."""
    arch = _architecture(cfg)
    hidden = positive_int(cfg, "hidden_size")
    heads = positive_int(cfg, "num_attention_heads")
    kv_heads = positive_int(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(f"config.json: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
    head_dim = cfg.get("head_dim")
    if head_dim is None and arch == "Qwen3ForCausalLM":
        head_dim = 128  # Qwen3Config's default: its head_dim is independent of hidden_size
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"config.json: num_attention_heads ({heads}) must divide hidden_size ({hidden})")
        head_dim = hidden // heads
    head_dim = positive_int({"head_dim": head_dim}, "head_dim")
    if head_dim % 2:
        raise ValueError(f"config.json: head_dim must be even for rotary embeddings, got {head_dim}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("use_sliding_window", False):
        raise ValueError("config.json: sliding-window attention (use_sliding_window) is not supported")
    if arch == "MixtralForCausalLM" and cfg.get("sliding_window") is not None:
        raise ValueError("config.json: sliding-window attention (Mixtral sliding_window) is not supported")
    moe, sparse = parse_softmax_moe(cfg, arch) if arch in MOE_ARCHITECTURES else (None, ())

    max_positions = positive_int(cfg, "max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])
    theta, scaling = _rope(cfg, max_positions, 1e6 if arch == "MixtralForCausalLM" else _DEFAULT_ROPE_THETA)
    attention_bias = bool(cfg.get("attention_bias", False))
    vocab = positive_int(cfg, "vocab_size")
    eos = first_id(cfg.get("eos_token_id"))
    if eos is not None and not 0 <= eos < vocab:
        raise ValueError(f"config.json: eos_token_id {eos} is outside the vocabulary (size {vocab})")
    eps = float(cfg.get("rms_norm_eps", _DEFAULT_RMS_EPS.get(arch, 1e-6)))
    if eps <= 0:
        raise ValueError(f"config.json: rms_norm_eps must be positive, got {eps}")
    return GPTConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=positive_int(cfg, "intermediate_size", _DEFAULT_INTERMEDIATE.get(arch)),
        num_hidden_layers=positive_int(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
        mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in _QK_NORM,
        eos_token_id=eos,
        torch_dtype=cfg.get("dtype", cfg.get("torch_dtype")),
        moe=moe,
        sparse_layers=sparse,
    )
