import pytest

from megatron_async.models.model_config import parse_gpt_config


def base(arch="LlamaForCausalLM", **kw):
    cfg = {
        "architectures": [arch],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
    }
    cfg.update(kw)
    return cfg


def test_llama_defaults_and_flags():
    c = parse_gpt_config(base(attention_bias=True, mlp_bias=True, eos_token_id=[7, 8], torch_dtype="bfloat16"))
    assert (c.head_dim, c.num_key_value_heads, c.max_position_embeddings) == (16, 2, 2048)
    assert c.qkv_bias and c.o_bias and c.mlp_bias and not c.qk_norm
    assert c.eos_token_id == 7 and c.torch_dtype == "bfloat16"
    assert c.rope_theta == 10000.0 and c.rope_scaling is None and not c.tie_word_embeddings


def test_qwen2_has_qkv_bias_only():
    c = parse_gpt_config(base("Qwen2ForCausalLM", rope_theta=1e6, tie_word_embeddings=True))
    assert c.qkv_bias and not c.o_bias and not c.mlp_bias and not c.qk_norm
    assert c.rope_theta == 1e6 and c.tie_word_embeddings and c.max_position_embeddings == 32768


def test_qwen3_head_dim_is_explicit_or_hf_default():
    c = parse_gpt_config(base("Qwen3ForCausalLM", head_dim=32, num_attention_heads=3, num_key_value_heads=1))
    assert c.head_dim == 32 and c.qk_norm and not c.qkv_bias  # 3 heads need not divide hidden
    assert parse_gpt_config(base("Qwen3ForCausalLM")).head_dim == 128


def test_kv_heads_default_to_heads_and_model_type_fallback():
    cfg = base()
    del cfg["num_key_value_heads"], cfg["architectures"]
    cfg["model_type"] = "qwen2"
    c = parse_gpt_config(cfg)
    assert c.num_key_value_heads == 4 and c.architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize(
    "params, expect",
    [
        ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
        ({"type": "dynamic", "factor": 3.0}, {"rope_type": "dynamic", "factor": 3.0}),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 512},
            {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 512},
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16,
             "attention_factor": 1.5, "truncate": False},
            {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "attention_factor": 1.5, "truncate": False},
        ),
        # yarn without factor: the ratio of context lengths (HF's fallback)
        ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 512},
         {"factor": 4.0, "original_max_position_embeddings": 512}),
    ],
)
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_rope_types(params, expect, key):
    c = parse_gpt_config(base(max_position_embeddings=2048, rope_theta=5e5, **{key: dict(params)}))
    for field, value in expect.items():
        assert getattr(c.rope_scaling, field) == value, field
    assert c.rope_theta == 5e5


def test_rope_parameters_theta_and_default_type():
    c = parse_gpt_config(base(rope_parameters={"rope_type": "default", "rope_theta": 123.0}))
    assert c.rope_scaling is None and c.rope_theta == 123.0


def test_yarn_original_defaults_to_max_positions():
    c = parse_gpt_config(base(max_position_embeddings=300, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    assert c.rope_scaling.original_max_position_embeddings == 300


def test_parses_what_transformers_writes():
    from tests.helpers.hf_models import make_tiny_config

    hf = make_tiny_config(
        "LlamaForCausalLM",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ).to_dict()
    c = parse_gpt_config(hf)
    assert c.rope_scaling.rope_type == "llama3" and c.rope_scaling.high_freq_factor == 4.0
    assert c.rope_theta == 10000.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_attention_heads": 5, "num_key_value_heads": 5}, "must divide hidden_size"),
        ({"num_key_value_heads": 3}, "must divide num_attention_heads"),
        ({"hidden_size": None}, "missing required field 'hidden_size'"),
        ({"vocab_size": 0}, "'vocab_size' must be a positive integer"),
        ({"architectures": ["BertModel"]}, "not a GPT decoder"),
        ({"architectures": None}, "neither 'architectures'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "unsupported rope_type 'longrope'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs a 'factor'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor, high_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"eos_token_id": 100}, "outside the vocabulary"),
        ({"head_dim": 15}, "must be even"),
    ],
)
def test_errors(overrides, message):
    cfg = base(**overrides)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        parse_gpt_config(cfg)
