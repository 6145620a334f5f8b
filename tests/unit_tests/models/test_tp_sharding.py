"""GPT sharding for tensor parallelism, checked in one process by posing as a TP rank
(the module state a TP group would set), without any collective."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_async.models.checkpoint import load_checkpoint
from megatron_async.models.gpt import GPTModel
from megatron_async.models.model_config import parse_gpt_config
from megatron_async.parallel import state
from megatron_async.testing.hf_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen2_ckpt(tmp_path_factory):
    # Qwen2 has q/k/v biases, so they are sharded too
    return make_tiny_checkpoint("Qwen2ForCausalLM", tmp_path_factory.mktemp("qwen2"), num_attention_heads=4,
                                num_key_value_heads=2)


def pose_as(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(state, "_rank", rank)
    monkeypatch.setattr(state, "_size", size)


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_loads_its_slice_of_each_projection(qwen2_ckpt, monkeypatch, rank):
    pose_as(monkeypatch, rank, 2)
    model, _ = load_checkpoint(qwen2_ckpt)
    hf = load_file(str(qwen2_ckpt / "model.safetensors"))
    half = lambda t, dim=0: t.chunk(2, dim)[rank]  # noqa: E731
    p = "model.layers.1"
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    qkv = [half(hf[f"{p}.self_attn.{n}_proj.weight"]) for n in "qkv"]
    assert torch.equal(attn.qkv_weight, torch.cat(qkv))
    assert torch.equal(attn.qkv_bias, torch.cat([half(hf[f"{p}.self_attn.{n}_proj.bias"]) for n in "qkv"]))
    assert torch.equal(attn.o_weight, half(hf[f"{p}.self_attn.o_proj.weight"], 1))
    gate_up = [half(hf[f"{p}.mlp.{n}_proj.weight"]) for n in ("gate", "up")]
    assert torch.equal(mlp.gate_up_weight, torch.cat(gate_up))
    assert torch.equal(mlp.down_weight, half(hf[f"{p}.mlp.down_proj.weight"], 1))
    assert torch.equal(model.embed_weight, half(hf["model.embed_tokens.weight"]))
    assert torch.equal(model.norm.weight, hf["model.norm.weight"])  # replicated
    assert model.kv_cache_spec().num_kv_heads == 1


def test_tp1_targets_are_plain_tensors(qwen2_ckpt):
    model, _ = load_checkpoint(qwen2_ckpt)
    assert all(isinstance(t, torch.Tensor) for t in model.hf_targets().values())
    assert model.kv_cache_spec().num_kv_heads == 2


@pytest.mark.parametrize("field,heads", [("num_key_value_heads", 8), ("num_attention_heads", 6)])
def test_indivisible_heads_are_refused(monkeypatch, field, heads):
    cfg = parse_gpt_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "intermediate_size": 96,
                            "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": 2,
                            "vocab_size": 96, "max_position_embeddings": 64})
    pose_as(monkeypatch, 0, 4)
    with pytest.raises(ValueError, match=f"{field} .* divisible by tensor_parallel_size \\(4\\)"):
        GPTModel(cfg, torch.float32, "cpu")


def test_mis_sized_tensor_is_reported_by_name(qwen2_ckpt, tmp_path, monkeypatch):
    hf = load_file(str(qwen2_ckpt / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    hf[name] = torch.cat([hf[name], hf[name]])  # twice the rows: must not be silently sliced
    bad = tmp_path / "bad"
    shutil.copytree(qwen2_ckpt, bad)
    save_file(hf, str(bad / "model.safetensors"))
    pose_as(monkeypatch, 1, 2)
    with pytest.raises(ValueError, match="k_proj.weight"):
        load_checkpoint(bad)
