"""Model sharding for tensor parallelism, checked in one process: a ParallelState names the rank
and size, and loading needs no process group (the weight loaders only slice)."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_async.models import build_default_model
from megatron_async.models.checkpoint import load_checkpoint
from megatron_async.models.gpt import GPTModel
from megatron_async.models.hybrid import build_hybrid
from megatron_async.models.model_config import parse_gpt_config
from megatron_async.parallel.state import ParallelState
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint
from tests.helpers.hf_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen2_ckpt(tmp_path_factory):
    # Qwen2 has q/k/v biases, so they are sharded too
    return make_tiny_checkpoint("Qwen2ForCausalLM", tmp_path_factory.mktemp("qwen2"), num_attention_heads=4,
                                num_key_value_heads=2)


@pytest.fixture(scope="module")
def nemotron_ckpt(tmp_path_factory):
    return make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path_factory.mktemp("nemotron"))


def rank(r: int, size: int) -> ParallelState:
    return ParallelState(tp_rank=r, tp_size=size)


@pytest.mark.parametrize("r", [0, 1])
def test_rank_loads_its_slice_of_each_projection(qwen2_ckpt, r):
    model, _ = load_checkpoint(qwen2_ckpt, parallel=rank(r, 2))
    hf = load_file(str(qwen2_ckpt / "model.safetensors"))
    half = lambda t, dim=0: t.chunk(2, dim)[r]  # noqa: E731
    p = "model.layers.1"
    attn, mlp = model.blocks[2].mixer, model.blocks[3].mixer  # HF layer 1 = blocks 2 (attention) and 3 (MLP)
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    qkv = [half(hf[f"{p}.self_attn.{n}_proj.weight"]) for n in "qkv"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat(qkv))
    assert torch.equal(attn.qkv_proj.bias, torch.cat([half(hf[f"{p}.self_attn.{n}_proj.bias"]) for n in "qkv"]))
    assert torch.equal(attn.o_proj.weight, half(hf[f"{p}.self_attn.o_proj.weight"], 1))
    gate_up = [half(hf[f"{p}.mlp.{n}_proj.weight"]) for n in ("gate", "up")]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat(gate_up))
    assert torch.equal(mlp.down_proj.weight, half(hf[f"{p}.mlp.down_proj.weight"], 1))
    assert torch.equal(model.embed_tokens.weight, half(hf["model.embed_tokens.weight"]))
    assert torch.equal(model.final_norm.weight, hf["model.norm.weight"])  # replicated
    assert model.kv_cache_spec().num_kv_heads == 1


@pytest.mark.parametrize("r", [0, 1])
def test_mamba_mixer_takes_its_heads_and_groups(nemotron_ckpt, r):
    """in_proj's z / x / B / C / dt parts, the conv channels x / B / C, A / D / dt_bias and the
    gated norm are each cut by this rank's heads or groups (4 heads, 2 groups, TP 2)."""
    model, _ = load_checkpoint(nemotron_ckpt, parallel=rank(r, 2))
    hf = load_file(str(nemotron_ckpt / "model.safetensors"))
    mixer, p = model.blocks[0].mixer, "backbone.layers.0.mixer"
    c = mixer.cfg
    I, GN, H = c.intermediate_size, c.n_groups * c.d_state, c.num_heads
    half = lambda t: t.chunk(2)[r]  # noqa: E731

    def parts(t, sizes):
        return torch.cat([half(x) for x in t.split(sizes)])

    assert (mixer.num_heads, mixer.n_groups) == (H // 2, c.n_groups // 2)
    assert torch.equal(mixer.in_proj.weight, parts(hf[f"{p}.in_proj.weight"], [I, I, GN, GN, H]))
    assert torch.equal(mixer.conv1d.weight, parts(hf[f"{p}.conv1d.weight"], [I, GN, GN]))
    assert torch.equal(mixer.conv1d.bias, parts(hf[f"{p}.conv1d.bias"], [I, GN, GN]))
    for name in ("A_log", "D", "dt_bias"):
        assert torch.equal(getattr(mixer, name), half(hf[f"{p}.{name}"]))
    assert torch.equal(mixer.norm.weight, half(hf[f"{p}.norm.weight"]))
    assert torch.equal(mixer.out_proj.weight, hf[f"{p}.out_proj.weight"].chunk(2, 1)[r])
    spec, full = model.mamba_state_spec(), load_checkpoint(nemotron_ckpt)[0].mamba_state_spec()
    assert spec.ssm_shape == (full.ssm_shape[0] // 2, *full.ssm_shape[1:])
    assert spec.conv_shape == (full.conv_shape[0] // 2, full.conv_shape[1])


def test_single_process_model_is_unsharded(qwen2_ckpt):
    model, _ = load_checkpoint(qwen2_ckpt)
    hf = load_file(str(qwen2_ckpt / "model.safetensors"))
    assert model.parallel.tp_size == 1 and model.kv_cache_spec().num_kv_heads == 2
    assert torch.equal(model.blocks[0].mixer.qkv_proj.weight, torch.cat(
        [hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]))


def test_built_in_model_shards_are_slices_of_the_full_model():
    """The built-in model draws FULL tensors and loads them through the same loaders: TP shards
    are exact slices of the TP=1 weights (so TP=N runs the same model)."""
    full = build_default_model("tiny")
    shards = [build_default_model("tiny", parallel=rank(r, 2)) for r in range(2)]
    q_full = full.blocks[0].mixer.qkv_proj.weight
    q, kv = full.blocks[0].mixer.q_size, full.blocks[0].mixer.kv_size
    q_parts, k_parts = q_full[:q].chunk(2), q_full[q:q + kv].chunk(2)
    for r, shard in enumerate(shards):
        attn = shard.blocks[0].mixer
        assert torch.equal(attn.qkv_proj.weight[: attn.q_size], q_parts[r])
        assert torch.equal(attn.qkv_proj.weight[attn.q_size: attn.q_size + attn.kv_size], k_parts[r])
        assert torch.equal(shard.embed_tokens.weight, full.embed_tokens.weight.chunk(2)[r])
        assert torch.equal(shard.blocks[7].mixer.down_proj.weight, full.blocks[7].mixer.down_proj.weight.chunk(2, 1)[r])


@pytest.mark.parametrize("field,heads", [("num_key_value_heads", 8), ("num_attention_heads", 6)])
def test_indivisible_heads_are_refused(field, heads):
    cfg = parse_gpt_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "intermediate_size": 96,
                            "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": 2,
                            "vocab_size": 96, "max_position_embeddings": 64})
    with pytest.raises(ValueError, match=f"{field} .* divisible by tensor_parallel_size \\(4\\)"):
        GPTModel(cfg, rank(0, 4), torch.float32, "cpu")


HYBRID_BASE = {"architectures": ["NemotronHForCausalLM"], "hidden_size": 32, "vocab_size": 128,
               "hybrid_override_pattern": "M*-", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "intermediate_size": 64, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2}


@pytest.mark.parametrize("override,message", [
    ({"mamba_num_heads": 3, "n_groups": 1}, "Mamba num_heads \\(3\\)"),
    ({"mamba_num_heads": 6, "n_groups": 3}, "Mamba n_groups \\(3\\)"),
    ({"n_groups": 1}, "Mamba n_groups \\(1\\)"),
    ({"num_key_value_heads": 1}, "num_key_value_heads \\(1\\)"),
    ({"vocab_size": 127}, "vocab_size \\(127\\)"),
    ({"intermediate_size": 63}, "intermediate_size \\(63\\)"),
])
def test_hybrid_shapes_that_do_not_divide_are_refused(override, message):
    with pytest.raises(ValueError, match=f"{message} must be divisible by tensor_parallel_size \\(2\\)"):
        build_hybrid({**HYBRID_BASE, **override}, torch.float32, "meta", rank(1, 2))


def test_mis_sized_tensor_is_reported_by_name(qwen2_ckpt, tmp_path):
    hf = load_file(str(qwen2_ckpt / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    hf[name] = torch.cat([hf[name], hf[name]])  # twice the rows: must not be silently sliced
    bad = tmp_path / "bad"
    shutil.copytree(qwen2_ckpt, bad)
    save_file(hf, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj.weight' has shape \\(64, 64\\), the model expects \\(32, 64\\)"):
        load_checkpoint(bad, parallel=rank(1, 2))
