import pytest
import torch

from megatron_async.models.layers.norm import RMSNorm
from megatron_async.models.layers.rope import RotaryEmbedding, apply_rotary
from megatron_async.models.model_config import parse_gpt_config
from tests.helpers.hf_models import make_tiny_config

ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                    "mscale": 0.8, "mscale_all_dim": 0.6, "beta_fast": 16, "beta_slow": 2},
}
MAX_POS = 1024


def _pair(case: str, dtype=torch.float32):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = make_tiny_config(
        "LlamaForCausalLM", hidden_size=512, num_attention_heads=4, max_position_embeddings=MAX_POS,
        rope_theta=50000.0, rope_scaling=ROPE_CASES[case],
    )
    ours_cfg = parse_gpt_config(hf_cfg.to_dict())
    ours = RotaryEmbedding(ours_cfg.head_dim, MAX_POS, ours_cfg.rope_theta, ours_cfg.rope_scaling, dtype, "cpu")
    return LlamaRotaryEmbedding(hf_cfg), ours


def _hf_cos_sin(hf, positions, dtype=torch.float32):
    cos, sin = hf(torch.zeros(1, dtype=dtype), positions[None])
    half = cos.shape[-1] // 2
    assert torch.equal(cos[0, :, :half], cos[0, :, half:])  # HF duplicates the half table
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_tables_match_hf(case):
    hf, ours = _pair(case)
    positions = torch.tensor([0, 1, 7, 100, 255, 256, 511, 700, MAX_POS - 1])
    cos_ref, sin_ref = _hf_cos_sin(hf, positions)
    cos, sin = ours(positions)
    torch.testing.assert_close(cos, cos_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, sin_ref, rtol=1e-5, atol=1e-5)


def test_dynamic_beyond_max_positions_matches_hf_token_by_token():
    # HF rescales dynamic NTK with the current sequence length; while decoding one token
    # at a time that is position + 1, which is what each row of our table uses.
    hf, ours = _pair("dynamic")
    for p in range(MAX_POS - 2, MAX_POS + 40, 7):
        cos_ref, sin_ref = _hf_cos_sin(hf, torch.tensor([p]))
        ours.reserve(p + 1)
        cos, sin = ours(torch.tensor([p]))
        torch.testing.assert_close(cos, cos_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin, sin_ref, rtol=1e-5, atol=1e-5)


def test_reserve_grows_and_keeps_rows():
    _, ours = _pair("linear")
    before = ours.table[:MAX_POS].clone()
    assert ours.num_positions == MAX_POS
    ours.reserve(MAX_POS + 1)
    assert ours.num_positions == 2 * MAX_POS  # geometric growth
    assert torch.equal(ours.table[:MAX_POS], before)


def test_apply_rotary_matches_hf_bf16():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf, ours = _pair("yarn", torch.bfloat16)
    positions = torch.arange(0, 600, 37)
    T, H, D = len(positions), 3, ours.head_dim
    q = torch.randn(T, H, D, dtype=torch.bfloat16)
    k = torch.randn(T, 1, D, dtype=torch.bfloat16)
    cos, sin = hf(q, positions[None])  # [1, T, D] in bf16
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    c, s = ours(positions)
    assert torch.equal(apply_rotary(q, c, s), q_ref[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, c, s), k_ref[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf_exactly(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    ours = RMSNorm(48, 1e-5, dtype, "cpu")
    w = torch.randn(48).to(dtype)
    ref.weight.data.copy_(w)
    ours.weight.data.copy_(w)
    x = torch.randn(5, 48).to(dtype) * 3
    assert torch.equal(ours(x), ref(x))
