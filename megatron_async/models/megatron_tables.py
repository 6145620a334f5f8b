"""Megatron-Core parameter names of each architecture, declared beside the Hugging Face names
(``weight_loading.hf_targets``): one table of ``Rule``s per HF ``architectures[0]``.

A rule says, for one Megatron-Core tensor (as ``named_parameters()`` / ``state_dict()`` of a
``GPTModel`` or ``MambaModel`` spell it, local-spec name first, then Transformer-Engine and
grouped-expert aliases):
  - which HF tensors it holds (``hf``, one per part),
  - how the rows of the FULL Megatron tensor lie over those HF tensors (``Layout``),
  - how a Megatron TP rank's shard is cut from the full tensor (``Split``),
  - whether ``{expert}`` in its name is a local expert index of the sending EP rank.
``megatron_layouts.py`` turns a (name, shard) into slabs with these rules."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Layout(str, Enum):
    """How the rows (dim 0) of the FULL Megatron tensor map onto its HF tensors."""

    SAME = "same"
    """One HF tensor, same layout (also Mamba's in_proj [z|x|B|C|dt] and conv1d [x|B|C])."""
    QKV = "qkv"
    """linear_qkv: per query group g, its query heads, then its key head, then its value head
    (groups * (heads/groups + 2) * head_dim rows) -> q_proj, k_proj, v_proj (weight or bias)."""
    GATE_UP = "gate_up"
    """linear_fc1 of a gated MLP: [gate; up] -> gate_proj, up_proj."""


class Split(str, Enum):
    """How a Megatron TP rank's shard is cut from the full Megatron tensor."""

    REPLICATED = "replicated"
    """Every rank holds the whole tensor (norms, routers, biases of row-parallel layers)."""
    COLUMN = "column"
    """dim 0, contiguous: rank r holds rows [r*n/tp, (r+1)*n/tp). linear_qkv is this: with tp <=
    query groups a rank holds whole groups; with tp > groups Megatron cuts inside a group."""
    COLUMN_PARTS = "column_parts"
    """dim 0, each part (``Rule.parts``) split separately: rank r holds [part0_r; part1_r; ...]
    (gated fc1 [gate_r; up_r]; Mamba in_proj [z_r; x_r; B_r; C_r; dt_r]; conv1d [x_r; B_r; C_r])."""
    ROW = "row"
    """dim 1, contiguous (linear_proj, linear_fc2, Mamba out_proj)."""
    VOCAB = "vocab"
    """dim 0, contiguous over the PADDED vocabulary (rows >= the HF vocabulary are dropped)."""


@dataclass(frozen=True, eq=False)
class Rule:
    megatron: tuple[str, ...]
    """Accepted Megatron names (patterns with {layer} / {expert}): the local-spec name first,
    then its aliases (Transformer-Engine fused norms, grouped experts)."""
    hf: tuple[str, ...]
    """HF tensor names, one per part (patterns with {layer} / {expert})."""
    layout: Layout = Layout.SAME
    split: Split = Split.REPLICATED
    parts: tuple[str, ...] = ()
    """``Dims`` fields: the sizes of the parts along dim 0 of the FULL tensor (COLUMN_PARTS)."""
    expert: bool = False
    """{expert} in the Megatron name is a LOCAL expert index of the sending EP rank."""


def _gpt_rules(mlp: str, moe: str, gate: str, up: str, down: str, qkv_bias: bool = False) -> tuple[Rule, ...]:
    L = "decoder.layers.{layer}"
    H = "model.layers.{layer}"
    att = f"{H}.self_attn"
    experts_fc1 = (f"{L}.mlp.experts.local_experts.{{expert}}.linear_fc1.weight", f"{L}.mlp.experts.linear_fc1.weight{{expert}}")
    experts_fc2 = (f"{L}.mlp.experts.local_experts.{{expert}}.linear_fc2.weight", f"{L}.mlp.experts.linear_fc2.weight{{expert}}")
    rules = [
        Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), split=Split.VOCAB),
        Rule((f"{L}.input_layernorm.weight", f"{L}.self_attention.linear_qkv.layer_norm_weight"),
             (f"{H}.input_layernorm.weight",)),
        Rule((f"{L}.self_attention.linear_qkv.weight",), tuple(f"{att}.{p}_proj.weight" for p in "qkv"),
             Layout.QKV, Split.COLUMN),
        Rule((f"{L}.self_attention.q_layernorm.weight",), (f"{att}.q_norm.weight",)),
        Rule((f"{L}.self_attention.k_layernorm.weight",), (f"{att}.k_norm.weight",)),
        Rule((f"{L}.self_attention.linear_proj.weight",), (f"{att}.o_proj.weight",), split=Split.ROW),
        Rule((f"{L}.self_attention.linear_proj.bias",), (f"{att}.o_proj.bias",)),
        Rule((f"{L}.pre_mlp_layernorm.weight", f"{L}.mlp.linear_fc1.layer_norm_weight"),
             (f"{H}.post_attention_layernorm.weight",)),
        Rule((f"{L}.mlp.linear_fc1.weight",), (f"{H}.{mlp}.gate_proj.weight", f"{H}.{mlp}.up_proj.weight"),
             Layout.GATE_UP, Split.COLUMN_PARTS, ("ffn", "ffn")),
        Rule((f"{L}.mlp.linear_fc2.weight",), (f"{H}.{mlp}.down_proj.weight",), split=Split.ROW),
        Rule((f"{L}.mlp.router.weight",), (f"{H}.{moe}.gate.weight",)),
        Rule(experts_fc1, (f"{H}.{moe}.experts.{{expert}}.{gate}.weight", f"{H}.{moe}.experts.{{expert}}.{up}.weight"),
             Layout.GATE_UP, Split.COLUMN_PARTS, ("moe_ffn", "moe_ffn"), expert=True),
        Rule(experts_fc2, (f"{H}.{moe}.experts.{{expert}}.{down}.weight",), split=Split.ROW, expert=True),
        Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",)),
        Rule(("output_layer.weight",), ("lm_head.weight",), split=Split.VOCAB),
    ]
    if qkv_bias:
        rules.append(Rule((f"{L}.self_attention.linear_qkv.bias",), tuple(f"{att}.{p}_proj.bias" for p in "qkv"),
                          Layout.QKV, Split.COLUMN))
    return tuple(rules)


def _nemotron_h_rules() -> tuple[Rule, ...]:
    L = "decoder.layers.{layer}"
    H = "backbone.layers.{layer}"
    mamba_parts = ("mamba_inner", "mamba_inner", "mamba_bc", "mamba_bc", "mamba_heads")
    conv_parts = ("mamba_inner", "mamba_bc", "mamba_bc")
    return (
        Rule(("embedding.word_embeddings.weight",), ("backbone.embeddings.weight",), split=Split.VOCAB),
        # a hybrid layer has one norm, under whichever name the trainer's layer spec gives it
        Rule((f"{L}.mixer.in_proj.layer_norm_weight", f"{L}.norm.weight",
              f"{L}.self_attention.linear_qkv.layer_norm_weight", f"{L}.input_layernorm.weight",
              f"{L}.mlp.linear_fc1.layer_norm_weight", f"{L}.pre_mlp_layernorm.weight"), (f"{H}.norm.weight",)),
        Rule((f"{L}.mixer.in_proj.weight",), (f"{H}.mixer.in_proj.weight",), split=Split.COLUMN_PARTS, parts=mamba_parts),
        Rule((f"{L}.mixer.conv1d.weight",), (f"{H}.mixer.conv1d.weight",), split=Split.COLUMN_PARTS, parts=conv_parts),
        Rule((f"{L}.mixer.conv1d.bias",), (f"{H}.mixer.conv1d.bias",), split=Split.COLUMN_PARTS, parts=conv_parts),
        Rule((f"{L}.mixer.dt_bias",), (f"{H}.mixer.dt_bias",), split=Split.COLUMN),
        Rule((f"{L}.mixer.A_log",), (f"{H}.mixer.A_log",), split=Split.COLUMN),
        Rule((f"{L}.mixer.D",), (f"{H}.mixer.D",), split=Split.COLUMN),
        Rule((f"{L}.mixer.norm.weight",), (f"{H}.mixer.norm.weight",), split=Split.COLUMN),
        Rule((f"{L}.mixer.out_proj.weight",), (f"{H}.mixer.out_proj.weight",), split=Split.ROW),
        Rule((f"{L}.self_attention.linear_qkv.weight",), tuple(f"{H}.mixer.{p}_proj.weight" for p in "qkv"),
             Layout.QKV, Split.COLUMN),
        Rule((f"{L}.self_attention.linear_proj.weight",), (f"{H}.mixer.o_proj.weight",), split=Split.ROW),
        Rule((f"{L}.mlp.linear_fc1.weight",), (f"{H}.mixer.up_proj.weight",), split=Split.COLUMN),
        Rule((f"{L}.mlp.linear_fc2.weight",), (f"{H}.mixer.down_proj.weight",), split=Split.ROW),
        Rule((f"{L}.mlp.router.weight",), (f"{H}.mixer.gate.weight",)),
        Rule((f"{L}.mlp.router.expert_bias",), (f"{H}.mixer.gate.e_score_correction_bias",)),
        Rule((f"{L}.mlp.experts.linear_fc1.weight{{expert}}", f"{L}.mlp.experts.local_experts.{{expert}}.linear_fc1.weight"),
             (f"{H}.mixer.experts.{{expert}}.up_proj.weight",), split=Split.COLUMN, expert=True),
        Rule((f"{L}.mlp.experts.linear_fc2.weight{{expert}}", f"{L}.mlp.experts.local_experts.{{expert}}.linear_fc2.weight"),
             (f"{H}.mixer.experts.{{expert}}.down_proj.weight",), split=Split.ROW, expert=True),
        Rule((f"{L}.mlp.shared_experts.linear_fc1.weight",), (f"{H}.mixer.shared_experts.up_proj.weight",),
             split=Split.COLUMN),
        Rule((f"{L}.mlp.shared_experts.linear_fc2.weight",), (f"{H}.mixer.shared_experts.down_proj.weight",),
             split=Split.ROW),
        Rule((f"{L}.mlp.fc1_latent_proj.weight",), (f"{H}.mixer.fc1_latent_proj.weight",)),
        Rule((f"{L}.mlp.fc2_latent_proj.weight",), (f"{H}.mixer.fc2_latent_proj.weight",)),
        Rule(("decoder.final_norm.weight", "decoder.final_layernorm.weight"), ("backbone.norm_f.weight",)),
        Rule(("output_layer.weight",), ("lm_head.weight",), split=Split.VOCAB),
    )


_DENSE = dict(mlp="mlp", moe="mlp", gate="gate_proj", up="up_proj", down="down_proj")
RULES: dict[str, tuple[Rule, ...]] = {
    "LlamaForCausalLM": _gpt_rules(**_DENSE),
    "Qwen2ForCausalLM": _gpt_rules(**_DENSE, qkv_bias=True),
    "Qwen3ForCausalLM": _gpt_rules(**_DENSE),
    "Qwen3MoeForCausalLM": _gpt_rules(**_DENSE),
    "MixtralForCausalLM": _gpt_rules(mlp="mlp", moe="block_sparse_moe", gate="w1", up="w3", down="w2"),
    "NemotronHForCausalLM": _nemotron_h_rules(),
}
"""Per architecture (HF ``config.json`` ``architectures[0]``): its Megatron-Core rules."""

IGNORED_SUFFIXES = ("._extra_state",)
"""Megatron state-dict entries that carry no weights (Transformer-Engine / FP8 metadata)."""

MEGATRON_PREFIXES = ("decoder.", "embedding.", "output_layer.")
"""Names that only Megatron-Core spells this way (``detect_format``)."""
