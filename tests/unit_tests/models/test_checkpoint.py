import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_async.models import load_checkpoint
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.helpers.simple_session import SimpleSession

ARCH = "Qwen3ForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(ARCH, tmp_path_factory.mktemp("ckpt"), num_hidden_layers=1)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _logits(model):
    return SimpleSession(model, max_seqs=1, max_len=16).step([(0, [3, 1, 4, 1, 5])])


def test_loads_model_and_config(ckpt):
    model, cfg = load_checkpoint(ckpt)
    assert cfg["architectures"] == [ARCH] and not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert torch.isfinite(_logits(model)).all()


def test_dtype_cast(ckpt):
    model, _ = load_checkpoint(ckpt, "cpu", "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ref = load_file(ckpt / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(model.blocks[1].mixer.down_proj.weight, ref.to(torch.bfloat16))  # layer 0: attention, MLP


def test_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_checkpoint(tmp_path)


def test_no_safetensors(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_checkpoint(d)


def _edit_config(d, **kw):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kw)
    (d / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c")
    _edit_config(d, architectures=["BertForMaskedLM"])
    with pytest.raises(ValueError, match="unsupported architecture 'BertForMaskedLM'"):
        load_checkpoint(d)
    _edit_config(d, architectures=[])
    with pytest.raises(ValueError, match="no 'architectures'"):
        load_checkpoint(d)


def test_shape_mismatch(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c")
    _edit_config(d, intermediate_size=96)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.(gate|up|down)_proj.weight' has shape"):
        load_checkpoint(d)


def test_missing_and_unexpected_tensors(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_norm.weight"]
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert "missing tensors: model.layers.0.self_attn.k_norm.weight" in msg
    assert "unexpected tensors: model.layers.0.extra.weight" in msg


def test_sharded_index_loads_same_weights(ckpt, tmp_path):
    sharded = make_tiny_checkpoint(ARCH, tmp_path / "sharded", num_hidden_layers=1, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    single, _ = load_checkpoint(ckpt)
    multi, _ = load_checkpoint(sharded)
    for (name, a), (_, b) in zip(single.state_dict().items(), multi.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # a shard the index names must exist
    next(sharded.glob("model-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="shard files that do not exist"):
        load_checkpoint(sharded)


def test_tied_checkpoint_may_carry_its_head(tmp_path):
    d = make_tiny_checkpoint(ARCH, tmp_path / "tied", num_hidden_layers=1, tie_word_embeddings=True)
    tensors = load_file(d / "model.safetensors")
    assert "lm_head.weight" not in tensors
    reference = _logits(load_checkpoint(d)[0])
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, d / "model.safetensors")
    assert torch.equal(_logits(load_checkpoint(d)[0]), reference)
