"""Megatron-Core names and fused layouts (models/megatron_tables.py, megatron_layouts.py), without
megatron-core: hand-built tensors in the documented layouts map onto the right HF rows (QKV
interleaved per query group, fc1 [gate; up] per TP rank, Mamba in_proj per part, row-parallel
along dim 1, local experts, pipeline offsets, padded vocabulary), and an engine at TP 1 / 2 (and
EP 2) updated from a trainer's shards at TP 1 / 2 / 4 equals the engine loaded from HF tensors."""
import re

import pytest
import torch

from megatron_async.models.megatron_layouts import (
    Dims, NameMap, Shard, UnknownTensorError, _chunked, _regex, detect_format, megatron_from_hf, megatron_names_of,
    megatron_slabs,
)
from megatron_async.models.slab_loading import WeightUpdateError
from megatron_async.models.weight_update import update_weights_in_place
from tests.helpers.refit_models import build, hf_weights, load_full, params, trainer_shards

GPT = NameMap.for_arch("Qwen3ForCausalLM")
DIMS = Dims(vocab=10, hidden=3, heads=4, groups=2, head_dim=2, ffn=4, moe_ffn=2, experts=4)


def assemble(slabs, shapes: dict) -> dict:
    """Full HF tensors written from slabs (NaN where nothing arrived; a second write fails)."""
    out = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
    for s in slabs:
        region = out[s.hf_name][tuple(slice(o, o + e) for o, e in zip(s.offset, s.extent))]
        assert torch.isnan(region).all(), f"{s.hf_name} written twice"
        region.copy_(s.tensor)
    return out


def qkv_reference():
    """q/k/v with distinct values and the documented fused order: per group, its 2 query heads,
    then its key head, then its value head (rows of head_dim 2)."""
    q = torch.arange(16.0).reshape(8, 2) + 100
    k = torch.arange(8.0).reshape(4, 2) + 200
    v = torch.arange(8.0).reshape(4, 2) + 300
    fused = torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]])
    return q, k, v, fused


@pytest.mark.parametrize("tp", [1, 2, 4])  # tp 4 > 2 groups: Megatron cuts inside a group
def test_qkv_groups_map_to_q_k_v(tp):
    q, k, v, fused = qkv_reference()
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    slabs = [s for r, chunk in enumerate(fused.chunk(tp)) for s in
             megatron_slabs(GPT, DIMS, name, tuple(chunk.shape), chunk, Shard(tp_rank=r, tp_size=tp))]
    h = "model.layers.0.self_attn"
    got = assemble(slabs, {f"{h}.q_proj.weight": (8, 2), f"{h}.k_proj.weight": (4, 2), f"{h}.v_proj.weight": (4, 2)})
    assert torch.equal(got[f"{h}.q_proj.weight"], q)
    assert torch.equal(got[f"{h}.k_proj.weight"], k)
    assert torch.equal(got[f"{h}.v_proj.weight"], v)


def test_fc1_shards_hold_gate_and_up_halves_and_fc2_splits_columns():
    gate, up = torch.arange(12.0).reshape(4, 3), torch.arange(12.0).reshape(4, 3) + 50
    shards = [torch.cat([gate[2 * r:2 * r + 2], up[2 * r:2 * r + 2]]) for r in range(2)]  # [gate_r; up_r]
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    slabs = [s for r, t in enumerate(shards) for s in megatron_slabs(GPT, DIMS, name, (4, 3), t, Shard(r, 2))]
    got = assemble(slabs, {"model.layers.1.mlp.gate_proj.weight": (4, 3), "model.layers.1.mlp.up_proj.weight": (4, 3)})
    assert torch.equal(got["model.layers.1.mlp.gate_proj.weight"], gate)
    assert torch.equal(got["model.layers.1.mlp.up_proj.weight"], up)
    down = torch.arange(12.0).reshape(3, 4)
    slabs = [s for r, t in enumerate(down.chunk(2, dim=1)) for s in
             megatron_slabs(GPT, DIMS, "decoder.layers.1.mlp.linear_fc2.weight", (3, 2), t, Shard(r, 2))]
    assert torch.equal(assemble(slabs, {"model.layers.1.mlp.down_proj.weight": (3, 4)})["model.layers.1.mlp.down_proj.weight"], down)


def test_mamba_in_proj_is_split_per_part():
    nh = NameMap.for_arch("NemotronHForCausalLM")
    dims = Dims(vocab=10, hidden=2, mamba_inner=4, mamba_bc=2, mamba_heads=2)
    full = torch.arange(16.0 * 2).reshape(16, 2)  # z 4, x 4, B 2, C 2, dt 2 ... = 16 rows
    sizes = [4, 4, 2, 2, 2]
    parts = full[:14].split(sizes)
    full = full[:14]
    shards = [torch.cat([p.chunk(2)[r] for p in parts]) for r in range(2)]
    name = "decoder.layers.0.mixer.in_proj.weight"
    slabs = [s for r, t in enumerate(shards) for s in megatron_slabs(nh, dims, name, (7, 2), t, Shard(r, 2))]
    got = assemble(slabs, {"backbone.layers.0.mixer.in_proj.weight": (14, 2)})
    assert torch.equal(got["backbone.layers.0.mixer.in_proj.weight"], full)


def test_experts_layers_vocab_padding_extra_state_and_ownership():
    t = torch.ones(4, 3)
    (s,) = megatron_slabs(GPT, DIMS, "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", (3, 2),
                          t[:3, :2], Shard(ep_rank=1, ep_size=2))
    assert s.hf_name == "model.layers.0.mlp.experts.3.down_proj.weight"  # 2 local experts per EP rank
    (s,) = megatron_slabs(GPT, DIMS, "decoder.layers.0.mlp.experts.linear_fc2.weight0", (3, 2), t[:3, :2],
                          Shard(ep_rank=1, ep_size=2, layer_offset=5))  # the grouped-expert spelling
    assert s.hf_name == "model.layers.5.mlp.experts.2.down_proj.weight"
    emb = torch.arange(16.0 * 3).reshape(16, 3)  # vocab 10 padded to 16, TP 2: rank 1 holds rows 8..15
    (s,) = megatron_slabs(GPT, DIMS, "embedding.word_embeddings.weight", (8, 3), emb[8:], Shard(1, 2))
    assert (s.offset, s.extent, s.full_shape) == ((8, 0), (2, 3), (10, 3)) and torch.equal(s.tensor, emb[8:10])
    assert megatron_slabs(GPT, DIMS, "decoder.layers.0.self_attention.linear_qkv._extra_state", (1,)) == []
    norm = "decoder.layers.0.input_layernorm.weight"
    assert megatron_slabs(GPT, DIMS, norm, (3,), torch.ones(3), Shard(1, 2)) == []  # tp rank 0's copy is used
    assert megatron_slabs(GPT, DIMS, norm, (3,), torch.ones(3), Shard(ep_rank=1, ep_size=2)) == []
    with pytest.raises(UnknownTensorError, match="unknown Megatron-Core tensor"):
        megatron_slabs(GPT, DIMS, "decoder.layers.0.self_attention.nope.weight", (3,))
    with pytest.raises(WeightUpdateError, match="local expert 2 outside"):
        megatron_slabs(GPT, DIMS, "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight", (3, 2),
                       shard=Shard(ep_size=2))


def test_format_detection():
    assert detect_format(["decoder.layers.0.mlp.linear_fc1.weight", "embedding.word_embeddings.weight"]) == "megatron"
    assert detect_format(["model.norm.weight", "mtp.layers.0.input_layernorm.weight"]) == "hf"
    with pytest.raises(WeightUpdateError, match="mixes"):
        detect_format(["model.norm.weight", "decoder.final_layernorm.weight"])


@pytest.mark.parametrize("kind,trainer,engine,ep", [
    ("dense", 4, 1, 1), ("dense", 4, 2, 1), ("dense", 1, 2, 1), ("dense", 2, 2, 1), ("qwen2", 2, 1, 1),
    ("moe", 2, 2, 2), ("moe", 1, 1, 1), ("hybrid", 2, 1, 1), ("hybrid", 1, 2, 1)])
def test_engine_from_trainer_shards_equals_engine_from_hf(kind, trainer, engine, ep):
    hf = hf_weights(kind, seed=3)
    shards = [item for rank in trainer_shards(kind, hf, trainer, ep) for item in rank]
    for rank in range(engine):
        for ep_rank in range(ep):
            want = params(load_full(build(kind, engine, rank, ep, ep_rank), hf))
            model = build(kind, engine, rank, ep, ep_rank)
            update_weights_in_place(model, shards)  # format detected from the names
            for name, p in model.named_parameters():
                assert torch.equal(p, want[name]), f"{name} (engine rank {rank}, ep {ep_rank})"


def test_padded_vocabulary_and_pipeline_stages():
    hf = hf_weights("dense", seed=4)
    model = build("dense")
    dims, shard_items = model.megatron_dims(), []
    for stage, (offset, layers) in enumerate([(0, 1), (1, 1)]):
        for r in range(2):
            shard = Shard(tp_rank=r, tp_size=2, layer_offset=offset)
            other_stage = ("output_layer", "decoder.final") if stage == 0 else ("embedding",)
            names = [n for n in megatron_names_of(GPT, hf, dims, shard, num_layers=layers)
                     if not n.startswith(other_stage)]
            tensors = megatron_from_hf(GPT, dims, hf, names, shard, padded_vocab=256)
            shard_items += [(n, t, shard) for n, t in tensors.items()]
    update_weights_in_place(model, shard_items, weights_format="megatron")
    want = params(load_full(build("dense"), hf))
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())


def test_shards_of_a_touched_tensor_must_all_arrive():
    hf = hf_weights("dense")
    model = build("dense")
    before = params(model)
    shards = trainer_shards("dense", hf, 2)
    with pytest.raises(WeightUpdateError, match="incomplete tensors"):
        update_weights_in_place(model, shards[0])  # tp rank 1's halves never came
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(WeightUpdateError, match="given twice"):
        update_weights_in_place(model, shards[0] + shards[1] + shards[1][2:3])


def test_unknown_megatron_names_are_all_named_and_nothing_changes():
    hf = hf_weights("dense")
    model = build("dense")
    before = params(model)
    items = [item for rank in trainer_shards("dense", hf, 1) for item in rank]
    items += [("decoder.layers.0.self_attention.nope.weight", torch.ones(2)), ("decoder.extra.weight", torch.ones(2))]
    with pytest.raises(WeightUpdateError, match="nothing was changed: unknown Megatron-Core tensors for Qwen3ForCausalLM: "
                                                "decoder.extra.weight, decoder.layers.0.self_attention.nope.weight"):
        update_weights_in_place(model, items)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                                  "NemotronHForCausalLM"])
def test_one_regex_matches_as_each_spelling_tried_in_order(arch):
    """NameMap tries every spelling as one regex's alternatives: the rule and fields it finds are
    those of the first spelling whose own regex matches."""
    names = NameMap.for_arch(arch)
    spellings = [(re.compile(_regex(p)), rule) for rule in names.rules for p in rule.megatron]

    def in_order(name):
        for regex, rule in spellings:
            if (m := regex.match(name)) is not None:
                return rule, {k: int(v) for k, v in m.groupdict().items()}

    tried = [p.format(layer=layer, expert=expert) for rule in names.rules for p in rule.megatron
             for layer in (0, 7, 31) for expert in (0, 5, 127)]
    tried += [n + "x" for n in tried[::7]] + [n[1:] for n in tried[::11]]
    tried.append("decoder.layers.x.mlp.router.weight")
    for name in tried:
        want, got = in_order(name), names.match(name)
        assert (got is None) if want is None else (got[0] is want[0] and got[1] == want[1]), name


def test_only_evenly_spaced_boxes_are_read_in_chunks():
    """(part, offset, extent, full shape, origin, dim, first row, rows) of 2-row boxes of one part,
    back to back in the HF tensor, from shard rows ``src``."""
    def box(src, dst):
        return 0, (dst, 0), (2, 3), (8, 3), (src, 0), 0, src, 2

    assert _chunked([box(0, 0), box(4, 2), box(8, 4)]) == [(0, (0, 0), (6, 3), (8, 3), (0, 0), (2, 4))]
    assert _chunked([box(0, 0), box(4, 2), box(9, 4)]) == [(0, (0, 0), (4, 3), (8, 3), (0, 0), (2, 4)),
                                                           (0, (4, 0), (2, 3), (8, 3), (9, 0), None)]
    assert _chunked([box(0, 0), box(2, 2)]) == [(0, (0, 0), (4, 3), (8, 3), (0, 0), None)]  # one block of the shard
    assert _chunked([box(0, 0), box(4, 4)]) == [(0, (0, 0), (2, 3), (8, 3), (0, 0), None),  # not back to back
                                                (0, (4, 0), (2, 3), (8, 3), (4, 0), None)]
