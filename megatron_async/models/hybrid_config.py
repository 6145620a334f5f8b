"""Typed view of a Hugging Face ``config.json`` for hybrid Mamba2 models:
NemotronH (Mamba2 / attention / MLP / MoE layers), Bamba (Mamba2 or attention + SwiGLU per layer)
and pure Mamba2. Defaults follow the transformers config classes, so a checkpoint that
omits a field behaves here as it does in ``transformers``; every inconsistency raises
ValueError naming the field."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any
from megatron_async.models.config_fields import first_id, positive_int
from megatron_async.models.model_config import AttentionConfig, LayerKind, MLPConfig
from megatron_async.models.moe_config import MoEConfig, parse_nemotron_moe


class HybridFamily(str, Enum):
    NEMOTRON_H = "NemotronHForCausalLM"
    BAMBA = "BambaForCausalLM"
    MAMBA2 = "Mamba2ForCausalLM"


_MODEL_TYPES = {"nemotron_h": HybridFamily.NEMOTRON_H, "bamba": HybridFamily.BAMBA, "mamba2": HybridFamily.MAMBA2}


# transformers 5.x ``layers_block_type`` names (and their legacy spellings).
_BLOCK_TYPES = {
    "linear_attention": LayerKind.MAMBA,
    "mamba": LayerKind.MAMBA,
    "full_attention": LayerKind.ATTENTION,
    "attention": LayerKind.ATTENTION,
    "mlp": LayerKind.MLP,
    "moe": LayerKind.MOE,
}


@dataclass(frozen=True)
class MambaConfig:
    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    dt_limit: tuple[float, float]
    """Clamp of the step size softplus(dt + dt_bias), applied on prefill and decode alike."""
    use_conv_bias: bool
    proj_bias: bool
    """Bias on in_proj and out_proj."""
    norm_eps: float
    norm_before_gate: bool
    """Gated RMSNorm order; every HF family gates first (y * silu(z), then the group norm)."""

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    @property
    def in_proj_size(self) -> int:
        """Rows of in_proj: z, x, B, C, dt."""
        return self.intermediate_size + self.conv_dim + self.num_heads

    @property
    def norm_group_size(self) -> int:
        return self.intermediate_size // self.n_groups


@dataclass(frozen=True)
class HybridConfig:
    family: HybridFamily
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerKind, ...]
    """Mixer of each HF layer. Bamba layers also end with a SwiGLU MLP (``mlp_after_mixer``)."""
    mamba: MambaConfig
    attention: AttentionConfig | None
    """None when no layer is attention."""
    mlp: MLPConfig | None
    """None when no layer has an MLP (pure Mamba2)."""
    norm_eps: float
    tie_word_embeddings: bool
    residual_in_fp32: bool
    """Keep the residual stream in float32 (Mamba2)."""
    eos_token_id: int | None
    max_position_embeddings: int
    moe: MoEConfig | None = None
    """The mixer of NemotronH 'E' (MoE) layers; None when there is none."""

    @property
    def mlp_after_mixer(self) -> bool:
        return self.family == HybridFamily.BAMBA

    @property
    def num_mamba_layers(self) -> int:
        return sum(k == LayerKind.MAMBA for k in self.layers)

    @property
    def num_attention_layers(self) -> int:
        return sum(k == LayerKind.ATTENTION for k in self.layers)


def _get(cfg: dict, names: tuple[str, ...], default: Any) -> Any:
    """First present key among ``names`` (current name first, then legacy aliases)."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _float(value: Any) -> float:
    # transformers writes non-finite floats into config.json as {"__float__": "Infinity"}.
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _dt_limit(value: Any) -> tuple[float, float]:
    if value is None:
        return 0.0, math.inf
    lo, hi = (_float(v) for v in value)
    if not 0.0 <= lo < hi:
        raise ValueError(f"config.json: time_step_limit must satisfy 0 <= low < high, got {value!r}")
    return lo, hi


def _family(cfg: dict) -> HybridFamily:
    archs = cfg.get("architectures") or []
    if archs:
        try:
            return HybridFamily(archs[0])
        except ValueError:
            raise ValueError(f"config.json: architecture {archs[0]!r} is not a hybrid Mamba model") from None
    family = _MODEL_TYPES.get(cfg.get("model_type", ""))
    if family is None:
        raise ValueError("config.json: neither 'architectures' nor a known hybrid 'model_type' is given")
    return family


def _nemotron_layers(cfg: dict) -> tuple[LayerKind, ...]:
    pattern = cfg.get("hybrid_override_pattern")
    block_types = cfg.get("layers_block_type")
    if pattern is not None:
        bad = sorted(set(pattern) - {k.value for k in LayerKind})
        if bad:
            raise ValueError(f"config.json: hybrid_override_pattern has unknown characters {bad} (allowed: M * - E)")
        layers = tuple(LayerKind(ch) for ch in pattern)
    elif block_types is not None:
        bad = sorted({t for t in block_types if t not in _BLOCK_TYPES})
        if bad:
            raise ValueError(f"config.json: layers_block_type has unknown types {bad}")
        layers = tuple(_BLOCK_TYPES[t] for t in block_types)
    else:
        raise ValueError("config.json: NemotronH needs 'hybrid_override_pattern' or 'layers_block_type'")
    n = cfg.get("num_hidden_layers")
    if n is not None and n != len(layers):
        raise ValueError(f"config.json: the layer pattern has {len(layers)} layers but num_hidden_layers is {n}")
    return layers


def _bamba_layers(cfg: dict) -> tuple[LayerKind, ...]:
    n = positive_int(cfg, "num_hidden_layers", 32)
    attn = cfg.get("attn_layer_indices") or []
    bad = [i for i in attn if not (isinstance(i, int) and 0 <= i < n)]
    if bad:
        raise ValueError(f"config.json: attn_layer_indices {bad} are outside [0, {n})")
    return tuple(LayerKind.ATTENTION if i in attn else LayerKind.MAMBA for i in range(n))


def _mamba_config(cfg: dict, family: HybridFamily, hidden: int, eps: float) -> MambaConfig:
    if family == HybridFamily.BAMBA:
        heads = positive_int(cfg, "mamba_n_heads", 128)
        inner = int(cfg.get("mamba_expand", 2)) * hidden
        head_dim = cfg.get("mamba_d_head", "auto")
        if head_dim in (None, "auto"):
            if inner % heads:
                raise ValueError(
                    f"config.json: mamba_n_heads ({heads}) must divide mamba_expand * hidden_size ({inner})"
                )
            head_dim = inner // heads
        fields = dict(
            d_state=_get(cfg, ("mamba_d_state",), 256),
            n_groups=_get(cfg, ("mamba_n_groups",), 1),
            conv_kernel=_get(cfg, ("mamba_d_conv",), 4),
            chunk_size=_get(cfg, ("mamba_chunk_size",), 256),
        )
        use_conv_bias, proj_bias = bool(cfg.get("mamba_conv_bias", True)), bool(cfg.get("mamba_proj_bias", False))
        dt_limit = _dt_limit(cfg.get("time_step_limit", (0.0, math.inf)))
        act = cfg.get("hidden_act", "silu")
    elif family == HybridFamily.NEMOTRON_H:
        # NemotronH's inner width is heads * head_dim; its `expand` is not used.
        heads = positive_int(cfg, "mamba_num_heads", 128)
        head_dim = _get(cfg, ("mamba_head_dim",), 64)
        inner = None
        fields = dict(
            d_state=_get(cfg, ("ssm_state_size",), 128),
            n_groups=_get(cfg, ("n_groups", "mamba_n_groups"), 8),
            conv_kernel=_get(cfg, ("conv_kernel", "mamba_d_conv"), 4),
            chunk_size=_get(cfg, ("chunk_size", "mamba_chunk_size"), 128),
        )
        use_conv_bias = bool(_get(cfg, ("use_conv_bias", "mamba_conv_bias"), True))
        proj_bias = bool(cfg.get("use_bias", False))
        # transformers' NemotronH mixer clamps dt to [time_step_min, inf) and ignores time_step_limit.
        dt_limit = (_float(_get(cfg, ("time_step_min", "mamba_dt_min"), 0.001)), math.inf)
        act = cfg.get("mamba_hidden_act", "silu")
    else:
        heads = positive_int(cfg, "num_heads", 128)
        head_dim = _get(cfg, ("head_dim",), 64)
        inner = int(cfg.get("expand", 2)) * hidden
        fields = dict(
            d_state=_get(cfg, ("state_size",), 128),
            n_groups=_get(cfg, ("n_groups",), 8),
            conv_kernel=_get(cfg, ("conv_kernel",), 4),
            chunk_size=_get(cfg, ("chunk_size",), 256),
        )
        use_conv_bias, proj_bias = bool(cfg.get("use_conv_bias", True)), bool(cfg.get("use_bias", False))
        dt_limit = _dt_limit(cfg.get("time_step_limit", (0.0, math.inf)))
        act = cfg.get("hidden_act", "silu")

    for name, value in [("head_dim", head_dim), *fields.items()]:
        positive_int({name: value}, name)
    if act != "silu":
        raise ValueError(f"config.json: Mamba activation {act!r} is not supported (only 'silu')")
    if inner is not None and heads * head_dim != inner:
        raise ValueError(
            f"config.json: Mamba heads * head_dim ({heads} * {head_dim}) must equal expand * hidden_size ({inner})"
        )
    if heads % fields["n_groups"]:
        raise ValueError(f"config.json: Mamba n_groups ({fields['n_groups']}) must divide the Mamba heads ({heads})")
    if fields["conv_kernel"] < 2:
        raise ValueError(f"config.json: Mamba conv kernel must be at least 2, got {fields['conv_kernel']}")
    return MambaConfig(
        num_heads=heads,
        head_dim=head_dim,
        dt_limit=dt_limit,
        use_conv_bias=use_conv_bias,
        proj_bias=proj_bias,
        norm_eps=eps,
        norm_before_gate=bool(cfg.get("norm_before_gate", False)),
        **fields,
    )


def _attention_config(cfg: dict, family: HybridFamily, hidden: int) -> AttentionConfig:
    heads = positive_int(cfg, "num_attention_heads")
    kv_heads = positive_int(cfg, "num_key_value_heads", 8)  # transformers' default for both families
    if heads % kv_heads:
        raise ValueError(f"config.json: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
    head_dim = _get(cfg, ("head_dim", "attention_head_dim"), 128)  # NemotronHConfig's default
    if family == HybridFamily.BAMBA:  # transformers' Bamba always uses hidden / heads
        if hidden % heads:
            raise ValueError(f"config.json: num_attention_heads ({heads}) must divide hidden_size ({hidden})")
        head_dim = hidden // heads
    positive_int({"head_dim": head_dim}, "head_dim")
    bias = bool(cfg.get("attention_bias", False))
    if family == HybridFamily.NEMOTRON_H:
        # No rotary embedding and no projection biases in transformers' NemotronH attention.
        return AttentionConfig(heads, kv_heads, head_dim, False, False, 0, 0.0)
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json: Bamba rope_type {rope_type!r} is not supported (only 'default')")
    # transformers hard-codes Bamba's partial_rotary_factor to 0.5, whatever config.json says.
    rotary_dim = int(head_dim * 0.5)
    if rotary_dim % 2:
        raise ValueError(f"config.json: Bamba rotary dims (head_dim / 2 = {rotary_dim}) must be even")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return AttentionConfig(heads, kv_heads, head_dim, bias, bias, rotary_dim, theta)


def parse_hybrid_config(cfg: dict) -> HybridConfig:
    """Validate a HF config dict of a NemotronH / Bamba / Mamba2 model."""
    family = _family(cfg)
    hidden = positive_int(cfg, "hidden_size")
    vocab = positive_int(cfg, "vocab_size")
    if family == HybridFamily.NEMOTRON_H:
        layers = _nemotron_layers(cfg)
        eps = float(cfg.get("layer_norm_epsilon", 1e-5))
    elif family == HybridFamily.BAMBA:
        layers = _bamba_layers(cfg)
        eps = float(cfg.get("rms_norm_eps", 1e-5))
    else:
        layers = (LayerKind.MAMBA,) * positive_int(cfg, "num_hidden_layers", 64)
        eps = float(cfg.get("layer_norm_epsilon", 1e-5))
    if not layers:
        raise ValueError("config.json: the model has no layers")
    if eps <= 0:
        raise ValueError(f"config.json: the norm epsilon must be positive, got {eps}")

    mlp = None
    if family == HybridFamily.BAMBA or LayerKind.MLP in layers:
        gated = family == HybridFamily.BAMBA
        act_key, want = ("hidden_act", "silu") if gated else ("mlp_hidden_act", "relu2")
        act = cfg.get(act_key, want)
        if act != want:
            raise ValueError(f"config.json: {act_key} {act!r} is not supported (only {want!r})")
        mlp = MLPConfig(positive_int(cfg, "intermediate_size"), gated, bool(cfg.get("mlp_bias", False)))
    attention = _attention_config(cfg, family, hidden) if LayerKind.ATTENTION in layers else None

    eos = first_id(cfg.get("eos_token_id"))
    if eos is not None and not 0 <= eos < vocab:
        raise ValueError(f"config.json: eos_token_id {eos} is outside the vocabulary (size {vocab})")
    default_positions = {HybridFamily.NEMOTRON_H: 4096, HybridFamily.BAMBA: 262144}
    # Mamba2 has no positional limit; the bound only caps the engine's max_sequence_length.
    max_positions = positive_int(cfg, "max_position_embeddings", default_positions.get(family, 1 << 20))
    return HybridConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        layers=layers,
        mamba=_mamba_config(cfg, family, hidden, eps),
        attention=attention,
        mlp=mlp,
        norm_eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        residual_in_fp32=family == HybridFamily.MAMBA2 and bool(cfg.get("residual_in_fp32", True)),
        eos_token_id=eos,
        max_position_embeddings=max_positions,
        moe=parse_nemotron_moe(cfg) if LayerKind.MOE in layers else None,
    )
