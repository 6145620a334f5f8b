"""MoE fields of Qwen3-MoE / Mixtral / NemotronH configs: HF defaults, which layers are sparse,
and a clear error for every unsupported or inconsistent variant."""
import pytest
import torch

from megatron_async.models.gpt import build_gpt
from megatron_async.models.hybrid_config import parse_hybrid_config
from megatron_async.models.model_config import LayerKind, parse_gpt_config
from megatron_async.models.moe_config import RouterScore


def qwen3moe(**kw):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "intermediate_size": 48}
    cfg.update(kw)
    return cfg


def mixtral(**kw):
    cfg = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "intermediate_size": 32,
           "num_local_experts": 4}
    cfg.update(kw)
    return cfg


def nemotron(**kw):
    cfg = {"architectures": ["NemotronHForCausalLM"], "hidden_size": 32, "vocab_size": 100,
           "hybrid_override_pattern": "ME*E", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 2, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 24}
    cfg.update(kw)
    return cfg


def test_qwen3moe_sparse_layers_and_defaults():
    c = parse_gpt_config(qwen3moe(mlp_only_layers=[0], decoder_sparse_step=2))
    assert c.sparse_layers == (False, True, False, True)
    m = c.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.score) == (8, 2, 16, RouterScore.SOFTMAX)
    assert not m.norm_topk_prob and m.weights_in_model_dtype and m.gated and c.qk_norm
    assert c.head_dim == 16  # Qwen3-MoE's head_dim defaults to hidden / heads (not Qwen3's 128)
    # transformers saves num_experts as num_local_experts
    cfg = qwen3moe(norm_topk_prob=True)
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert parse_gpt_config(cfg).moe.num_experts == 8 and parse_gpt_config(cfg).moe.norm_topk_prob


def test_mixtral_defaults():
    c = parse_gpt_config(mixtral())
    assert c.sparse_layers == (True, True) and c.moe.norm_topk_prob and not c.moe.weights_in_model_dtype
    assert (c.moe.hf_gate, c.moe.hf_up, c.moe.hf_down) == ("w1", "w3", "w2")
    assert c.rope_theta == 1e6 and c.rms_norm_eps == 1e-5 and not c.qk_norm


def test_nemotron_moe_defaults():
    c = parse_hybrid_config(nemotron())
    assert c.layers == (LayerKind.MAMBA, LayerKind.MOE, LayerKind.ATTENTION, LayerKind.MOE)
    m = c.moe
    assert m.score == RouterScore.SIGMOID and m.score_correction_bias and m.router_in_fp32 and not m.gated
    assert m.norm_topk_prob and m.shared_expert_intermediate_size == 24 and m.latent_size is None


def test_model_blocks_and_hf_names():
    model = build_gpt(qwen3moe(mlp_only_layers=[1]), torch.float32, "cpu")
    kinds = [b.kind for b in model.spec.blocks]
    A, E, D = LayerKind.ATTENTION, LayerKind.MOE, LayerKind.MLP
    assert kinds == [A, E, A, D, A, E, A, E]
    names = model.hf_shapes()
    assert names["model.layers.0.mlp.gate.weight"] == (8, 64)
    assert names["model.layers.0.mlp.experts.7.gate_proj.weight"] == (16, 64)
    assert names["model.layers.0.mlp.experts.7.down_proj.weight"] == (64, 16)
    assert names["model.layers.1.mlp.gate_proj.weight"] == (48, 64)
    mixtral_names = build_gpt(mixtral(), torch.float32, "cpu").hf_shapes()
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in mixtral_names


@pytest.mark.parametrize(
    "cfg, message",
    [
        (qwen3moe(num_experts_per_tok=9), r"num_experts_per_tok \(9\) exceeds"),
        (qwen3moe(mlp_only_layers=[4]), r"mlp_only_layers \[4\] are outside"),
        (qwen3moe(hidden_act="gelu"), "hidden_act 'gelu'"),
        (qwen3moe(num_experts=0), "num_experts"),
        (qwen3moe(use_sliding_window=True), "sliding-window"),
        (mixtral(sliding_window=4096), "sliding-window"),
        (mixtral(num_local_experts=1), r"num_experts_per_tok \(2\) exceeds"),
    ],
)
def test_bad_gpt_moe_configs_raise(cfg, message):
    with pytest.raises(ValueError, match=message):
        parse_gpt_config(cfg)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_group": 3}, r"n_group \(3\) must divide"),
        ({"n_group": 2, "topk_group": 3}, r"topk_group \(3\) exceeds"),
        ({"n_group": 8}, "at least 2 experts per group"),
        ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "fewer experts than num_experts_per_tok"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu'"),
        ({"moe_latent_size": 0}, "moe_latent_size"),
    ],
)
def test_bad_nemotron_moe_configs_raise(change, message):
    with pytest.raises(ValueError, match=message):
        parse_hybrid_config(nemotron(**change))
