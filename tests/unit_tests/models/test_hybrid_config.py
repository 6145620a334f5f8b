"""Parsing of NemotronH / Bamba / Mamba2 config.json dicts into HybridConfig, and bad configs."""
import json
import math

import pytest
import torch

from megatron_async.models.base import KVCacheSpec
from megatron_async.models.hybrid import build_hybrid
from megatron_async.models.hybrid_config import HybridFamily, LayerKind, parse_hybrid_config
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_config

M, A, MLP = LayerKind.MAMBA, LayerKind.ATTENTION, LayerKind.MLP


def _json(arch: str, **overrides) -> dict:
    """The config.json transformers would write (non-finite floats tagged as it does)."""
    return json.loads(make_tiny_hybrid_config(arch, **overrides).to_json_string())


def test_nemotron_h():
    cfg = parse_hybrid_config(_json("nemotron_h"))
    assert cfg.family == HybridFamily.NEMOTRON_H
    assert cfg.layers == (M, A, M, MLP)
    m = cfg.mamba
    # inner width is heads * head_dim (48), not expand * hidden (64)
    assert (m.num_heads, m.head_dim, m.d_state, m.n_groups, m.conv_kernel, m.chunk_size) == (4, 12, 8, 2, 4, 4)
    assert (m.intermediate_size, m.conv_dim, m.in_proj_size, m.norm_group_size) == (48, 80, 132, 24)
    assert m.dt_limit == (0.001, math.inf)  # transformers clamps at time_step_min
    att = cfg.attention
    assert (att.num_heads, att.num_kv_heads, att.head_dim, att.rotary_dim) == (4, 2, 16, 0)
    assert not att.qkv_bias and not att.o_bias
    assert cfg.mlp.gated is False and cfg.mlp.intermediate_size == 64
    assert not cfg.residual_in_fp32 and not cfg.mlp_after_mixer
    assert (cfg.num_mamba_layers, cfg.num_attention_layers) == (2, 1)


def test_nemotron_h_pattern_spellings():
    base = _json("nemotron_h")
    base.pop("layers_block_type")
    assert parse_hybrid_config({**base, "hybrid_override_pattern": "M-*M*"}).layers == (M, MLP, A, M, A)
    legacy = {**base, "layers_block_type": ["mamba", "attention", "mlp"]}
    assert parse_hybrid_config(legacy).layers == (M, A, MLP)
    old = {**base, "hybrid_override_pattern": "M*", "num_hidden_layers": 2, "mamba_d_conv": 3, "mamba_dt_min": 0.01}
    old.pop("conv_kernel")
    old.pop("time_step_min")
    parsed = parse_hybrid_config(old)
    assert parsed.mamba.conv_kernel == 3 and parsed.mamba.dt_limit[0] == 0.01


def test_bamba():
    cfg = parse_hybrid_config(_json("bamba", rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    assert cfg.family == HybridFamily.BAMBA and cfg.mlp_after_mixer
    assert cfg.layers == (M, A, M, M)
    assert cfg.mamba.head_dim == 16  # "auto": expand * hidden / heads
    assert cfg.mamba.dt_limit == (0.0, math.inf)
    att = cfg.attention
    assert (att.head_dim, att.rotary_dim, att.rope_theta) == (8, 4, 500.0)
    assert cfg.mlp.gated and cfg.max_position_embeddings == 512


def test_mamba2():
    cfg = parse_hybrid_config(_json("mamba2", n_groups=2, time_step_limit=(0.01, 5.0)))
    assert cfg.family == HybridFamily.MAMBA2
    assert cfg.layers == (M, M) and cfg.attention is None and cfg.mlp is None
    assert cfg.residual_in_fp32 and cfg.mamba.dt_limit == (0.01, 5.0)
    model = build_hybrid(_json("mamba2", n_groups=2), torch.float32, "cpu")
    assert model.kv_cache_spec().num_layers == 0
    spec = model.mamba_state_spec()
    assert (spec.num_layers, spec.conv_shape, spec.ssm_shape) == (2, (96, 3), (4, 16, 8))


def test_state_specs_count_blocks_by_kind():
    model = build_hybrid(_json("bamba"), torch.float32, "cpu")
    assert model.kv_cache_spec() == KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8)
    assert model.mamba_state_spec().num_layers == 3


@pytest.mark.parametrize(
    "arch, change, message",
    [
        ("nemotron_h", {"layers_block_type": None, "hybrid_override_pattern": "M*E", "n_routed_experts": 6,
                        "n_group": 4}, "n_group"),
        ("nemotron_h", {"layers_block_type": None, "hybrid_override_pattern": "M*X"}, "unknown characters"),
        (
            "nemotron_h",
            {"layers_block_type": None, "hybrid_override_pattern": "M*", "num_hidden_layers": 3},
            "num_hidden_layers",
        ),
        ("nemotron_h", {"layers_block_type": None}, "hybrid_override_pattern"),
        ("nemotron_h", {"n_groups": 3}, "n_groups"),
        ("nemotron_h", {"num_key_value_heads": 3}, "num_key_value_heads"),
        ("nemotron_h", {"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
        ("nemotron_h", {"conv_kernel": 1}, "conv kernel"),
        ("nemotron_h", {"mamba_head_dim": 0}, "head_dim"),
        ("bamba", {"attn_layer_indices": [7]}, "attn_layer_indices"),
        ("bamba", {"mamba_d_head": 5}, r"expand \* hidden_size"),
        ("bamba", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
        ("mamba2", {"num_heads": 3}, r"expand \* hidden_size"),
        ("mamba2", {"time_step_limit": [1.0, 0.5]}, "time_step_limit"),
        ("mamba2", {"hidden_act": "gelu"}, "activation"),
        ("mamba2", {"hidden_size": None}, "hidden_size"),
        ("mamba2", {"eos_token_id": 999}, "eos_token_id"),
        ("mamba2", {"architectures": ["LlamaForCausalLM"]}, "not a hybrid"),
    ],
)
def test_bad_configs_raise(arch, change, message):
    cfg = {**_json(arch), **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        parse_hybrid_config(cfg)


def test_model_type_without_architectures():
    cfg = _json("bamba")
    cfg.pop("architectures")
    assert parse_hybrid_config(cfg).family == HybridFamily.BAMBA
