"""In-place weight updates: the same tensors as loading the new checkpoint, storage kept, and a
refused update changes nothing."""
import pytest
import torch

from megatron_async.models import load_checkpoint
from megatron_async.models.weight_update import WeightUpdateError, update_weights_in_place
from megatron_async.parallel.sharding import full_shape
from tests.helpers.hf_models import load_hf_reference, make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_update")
    old = make_tiny_checkpoint("Qwen3ForCausalLM", root / "old", seed=0)
    new = make_tiny_checkpoint("Qwen3ForCausalLM", root / "new", seed=1, max_shard_size="20KB")
    return old, new


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _addresses(model):
    return {name: p.data_ptr() for name, p in model.named_parameters()}


@pytest.mark.parametrize("source", ["named_parameters", "directory"])
def test_update_equals_loading_the_new_checkpoint(checkpoints, source):
    old, new = checkpoints
    model, _ = load_checkpoint(old)
    expected, _ = load_checkpoint(new)
    before = _params(model)
    addresses = _addresses(model)
    weights = new if source == "directory" else list(load_hf_reference(new).named_parameters())
    copied = update_weights_in_place(model, weights)
    assert copied == len(model.hf_targets())
    assert _addresses(model) == addresses  # the same storage: captured graphs stay valid
    for name, p in model.named_parameters():
        assert torch.equal(p, dict(expected.named_parameters())[name]), name
        assert not torch.equal(p, before[name]), f"{name} did not change"


def test_partial_update_changes_only_the_named_tensor(checkpoints):
    old, new = checkpoints
    model, _ = load_checkpoint(old)
    before = _params(model)
    hf_new = dict(load_hf_reference(new).named_parameters())
    name = "model.layers.0.self_attn.k_proj.weight"  # one part of the fused qkv parameter
    assert update_weights_in_place(model, [(name, hf_new[name])]) == 1
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed == ["blocks.0.mixer.qkv_proj.weight"]
    param, shard_id = model.hf_targets()[name]
    assert full_shape(param, shard_id) == tuple(hf_new[name].shape)


@pytest.mark.parametrize("problem", ["unknown", "shape", "duplicate", "dtype", "not_a_pair"])
def test_bad_update_changes_nothing(checkpoints, problem):
    old, new = checkpoints
    model, _ = load_checkpoint(old)
    before = _params(model)
    good = list(load_hf_reference(new).named_parameters())
    bad = {
        "unknown": good + [("model.layers.9.mlp.nope.weight", torch.zeros(2))],
        "shape": good[:-1] + [(good[-1][0], torch.zeros(3, 3))],
        "duplicate": good + [good[0]],
        "dtype": good + [(good[0][0], torch.zeros(good[0][1].shape, dtype=torch.int64))],
        "not_a_pair": good + [("model.norm.weight", [1.0, 2.0])],
    }[problem]
    with pytest.raises(WeightUpdateError):
        update_weights_in_place(model, bad)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed although the update was refused"


def test_bad_checkpoint_directory_changes_nothing(checkpoints, tmp_path):
    old, _ = checkpoints
    other = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "other", seed=2, hidden_size=48)
    model, _ = load_checkpoint(old)
    before = _params(model)
    with pytest.raises(WeightUpdateError, match="wrong shapes"):
        update_weights_in_place(model, other)
    with pytest.raises(WeightUpdateError):
        update_weights_in_place(model, tmp_path / "missing")
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
