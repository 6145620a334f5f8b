"""The benchmark's checkpoint of a built-in model (megatron_async.models.default_checkpoint), written
shard by shard: transformers loads every tensor of it (no missing or unexpected names) and
gives the engine's logits, and the engine loads exactly its built-in weights from it."""
import json

import pytest
import torch

from megatron_async.models import build_default_model, load_checkpoint
from megatron_async.models.default_checkpoint import save_default_checkpoint
from tests.helpers.hf_models import hf_logits
from tests.helpers.simple_session import SimpleSession

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    # shards of 2 MiB: the tiny MoE model spreads over several files
    return save_default_checkpoint("tiny-moe", tmp_path_factory.mktemp("ckpt") / "tiny-moe", torch.device("cpu"),
                                   torch.float32, seed=3, shard_bytes=2 << 20)


def test_written_shard_by_shard_with_an_index(moe_ckpt):
    index = json.loads((moe_ckpt / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files == sorted(p.name for p in moe_ckpt.glob("model-*.safetensors"))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in index["weight_map"]  # HF Qwen3-MoE's per-expert names
    assert sum(p.stat().st_size for p in moe_ckpt.glob("*.safetensors")) >= index["metadata"]["total_size"]


def test_engine_loads_its_built_in_weights(moe_ckpt):
    model, _ = load_checkpoint(moe_ckpt, "cpu", torch.float32)
    ref = build_default_model("tiny-moe", "cpu", torch.float32, seed=3)
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_transformers_loads_it_and_matches_the_engine(moe_ckpt):
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model, _ = load_checkpoint(moe_ckpt, "cpu", torch.float32)
    prompts = [[3, 17, 250, 9, 44, 1000, 5], [8, 8, 120, 77]]
    logits = SimpleSession(model, max_seqs=2, max_len=16).step(list(enumerate(prompts)))
    offset = 0
    for prompt in prompts:
        theirs = hf_logits(hf.eval(), prompt)
        ours = logits[offset:offset + len(prompt)]
        offset += len(prompt)
        assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4
