"""Typed view of the mixture-of-experts fields of a Hugging Face ``config.json``: Qwen3-MoE and
Mixtral (softmax top-k routers, SwiGLU experts) and NemotronH MoE layers (sigmoid scores with
a correction bias, grouped top-k, routed scaling, relu^2 experts, a shared expert, optional
latent projection). Defaults follow the transformers config classes; unsupported variants
raise ValueError naming the field."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from megatron_async.models.config_fields import positive_int


class RouterScore(str, Enum):
    SOFTMAX = "softmax"
    """softmax over all experts, then top-k (Qwen3-MoE, Mixtral)."""
    SIGMOID = "sigmoid"
    """sigmoid scores; top-k chosen on scores + correction bias within the best groups
    (NemotronH, DeepSeek-V3); the weights are the uncorrected scores."""


@dataclass(frozen=True)
class MoEConfig:
    """One MoE mixer (full model sizes: layers take this rank's experts and columns)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    """Per routed expert."""
    gated: bool
    """True: SwiGLU experts down(silu(gate(x)) * up(x)); False: down(relu(up(x))^2)."""
    score: RouterScore
    norm_topk_prob: bool
    """Renormalise the k chosen weights to sum to one."""
    hf_gate: str | None
    """HF name of an expert's gate projection (None when not gated)."""
    hf_up: str
    hf_down: str
    num_groups: int = 1
    """Grouped top-k (sigmoid router): experts in ``num_groups`` equal groups; only the
    ``topk_groups`` groups with the best top-2 score sums are eligible."""
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    """The router carries ``e_score_correction_bias`` (added to the scores for the choice only)."""
    router_in_fp32: bool = False
    """Router logits computed from float32 hidden states and weights (NemotronH)."""
    weights_in_model_dtype: bool = False
    """Round the routing weights to the model dtype before use (Qwen3-MoE casts them)."""
    shared_expert_intermediate_size: int = 0
    """One always-on non-gated expert added to the routed output (NemotronH); 0 = none."""
    latent_size: int | None = None
    """Routed experts work in a ``latent_size`` space entered / left by two projections (NemotronH)."""
    mlp_bias: bool = False
    """Bias on the shared expert and latent projections."""


def _check_top_k(num_experts: int, top_k: int) -> None:
    if top_k > num_experts:
        raise ValueError(f"config.json: num_experts_per_tok ({top_k}) exceeds the number of experts ({num_experts})")


def parse_softmax_moe(cfg: dict, arch: str) -> tuple[MoEConfig, tuple[bool, ...]]:
    """Qwen3-MoE / Mixtral: (the MoE mixer, which of the num_hidden_layers layers are sparse)."""
    layers = positive_int(cfg, "num_hidden_layers")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported for MoE experts (only 'silu')")
    if arch == "MixtralForCausalLM":
        experts = positive_int(cfg, "num_local_experts", 8)
        top_k = positive_int(cfg, "num_experts_per_tok", 2)
        _check_top_k(experts, top_k)
        moe = MoEConfig(experts, top_k, positive_int(cfg, "intermediate_size", 14336), gated=True,
                        score=RouterScore.SOFTMAX, norm_topk_prob=True, hf_gate="w1", hf_up="w3", hf_down="w2")
        return moe, (True,) * layers
    # Qwen3-MoE: transformers names the field num_experts (saved as num_local_experts too)
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
    experts = positive_int({"num_experts": experts}, "num_experts")
    top_k = positive_int(cfg, "num_experts_per_tok", 8)
    _check_top_k(experts, top_k)
    step = positive_int(cfg, "decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    bad = sorted(i for i in dense if not (isinstance(i, int) and 0 <= i < layers))
    if bad:
        raise ValueError(f"config.json: mlp_only_layers {bad} are outside [0, {layers})")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    moe = MoEConfig(experts, top_k, positive_int(cfg, "moe_intermediate_size", 768), gated=True,
                    score=RouterScore.SOFTMAX, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    hf_gate="gate_proj", hf_up="up_proj", hf_down="down_proj", weights_in_model_dtype=True)
    return moe, sparse


def parse_nemotron_moe(cfg: dict) -> MoEConfig:
    """The MoE mixer of a NemotronH checkpoint ('E' layers)."""
    experts = cfg.get("n_routed_experts", cfg.get("num_local_experts", 8))
    experts = positive_int({"n_routed_experts": experts}, "n_routed_experts")
    top_k = positive_int(cfg, "num_experts_per_tok", 2)
    _check_top_k(experts, top_k)
    groups = positive_int(cfg, "n_group", 1)
    topk_groups = positive_int(cfg, "topk_group", 1)
    if experts % groups:
        raise ValueError(f"config.json: n_group ({groups}) must divide n_routed_experts ({experts})")
    if topk_groups > groups:
        raise ValueError(f"config.json: topk_group ({topk_groups}) exceeds n_group ({groups})")
    if groups > 1 and experts // groups < 2:
        raise ValueError("config.json: grouped routing needs at least 2 experts per group (n_routed_experts / n_group)")
    if groups > 1 and topk_groups * (experts // groups) < top_k:
        raise ValueError("config.json: topk_group groups hold fewer experts than num_experts_per_tok")
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"config.json: mlp_hidden_act {act!r} is not supported for NemotronH experts (only 'relu2')")
    # transformers' NemotronH always builds one shared expert (n_shared_experts is not read)
    shared_size = positive_int(cfg, "moe_shared_expert_intermediate_size", 7688)
    latent = cfg.get("moe_latent_size")
    if latent is not None:
        latent = positive_int({"moe_latent_size": latent}, "moe_latent_size")
    return MoEConfig(
        experts, top_k, positive_int(cfg, "moe_intermediate_size", 7688), gated=False, score=RouterScore.SIGMOID,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), hf_gate=None, hf_up="up_proj", hf_down="down_proj",
        num_groups=groups, topk_groups=topk_groups, routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        score_correction_bias=True, router_in_fp32=True, shared_expert_intermediate_size=shared_size,
        latent_size=latent, mlp_bias=bool(cfg.get("mlp_bias", False)),
    )
