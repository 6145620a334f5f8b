"""Parallel layers: every weight_loader keeps exactly this rank's slice of the FULL tensor (the
shards of all ranks concatenate back to it, part by part), mis-shaped tensors are refused, and
with real collectives (2 gloo ranks) the sharded layers compute what the full ones compute."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_async.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from megatron_async.parallel.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from megatron_async.parallel.sharding import full_shape
from megatron_async.parallel.state import ParallelState
from tests.helpers.multiprocess import run_ranks

F32 = torch.float32


def ranks(size: int) -> list[ParallelState]:
    return [ParallelState(tp_rank=r, tp_size=size) for r in range(size)]


def load(layers, name: str, full: torch.Tensor, shard_id=None) -> None:
    for layer in layers:
        param = getattr(layer, name)
        param.weight_loader(param, full, shard_id)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_column_shards_concatenate_to_the_full_weight(tp):
    layers = [ColumnParallelLinear(5, 12, True, p, F32, "cpu") for p in ranks(tp)]
    w, b = torch.randn(12, 5), torch.randn(12)
    load(layers, "weight", w)
    load(layers, "bias", b)
    assert torch.equal(torch.cat([lyr.weight for lyr in layers]), w)
    assert torch.equal(torch.cat([lyr.bias for lyr in layers]), b)
    assert full_shape(layers[0].weight) == (12, 5)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_row_shards_split_the_input_dim_and_replicate_the_bias(tp):
    layers = [RowParallelLinear(6, 4, True, p, F32, "cpu") for p in ranks(tp)]
    w, b = torch.randn(4, 6), torch.randn(4)
    load(layers, "weight", w)
    load(layers, "bias", b)
    assert torch.equal(torch.cat([lyr.weight for lyr in layers], dim=1), w)
    assert all(torch.equal(lyr.bias, b) for lyr in layers)


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_column_parts_are_split_separately(tp):
    """gate / up (shard ids 0, 1) loaded one HF tensor at a time, or a pre-fused tensor at once."""
    layers = [MergedColumnParallelLinear(3, [4, 8], False, p, F32, "cpu") for p in ranks(tp)]
    gate, up = torch.randn(4, 3), torch.randn(8, 3)
    load(layers, "weight", gate, 0)
    load(layers, "weight", up, 1)
    for r, lyr in enumerate(layers):
        assert torch.equal(lyr.weight, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
    fused = [MergedColumnParallelLinear(3, [4, 8], False, p, F32, "cpu") for p in ranks(tp)]
    load(fused, "weight", torch.cat([gate, up]))  # shard_id None: the whole stacked tensor
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(layers, fused))
    assert full_shape(layers[0].weight, 1) == (8, 3) and full_shape(layers[0].weight) == (12, 3)


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_ranks_own_whole_heads(tp):
    H, KV, D, hidden = 4, 2, 3, 5
    layers = [QKVParallelLinear(hidden, D, H, KV, True, p, F32, "cpu") for p in ranks(tp)]
    full = {n: torch.randn(h * D, hidden) for n, h in (("q", H), ("k", KV), ("v", KV))}
    for n, t in full.items():
        load(layers, "weight", t, n)
    for n in "qkv":
        heads = H if n == "q" else KV
        got = []
        for lyr in layers:
            q, k, v = lyr.weight.split([lyr.num_heads * D, lyr.num_kv_heads * D, lyr.num_kv_heads * D])
            got.append({"q": q, "k": k, "v": v}[n])
        assert torch.equal(torch.cat(got), full[n])
        assert all(g.shape[0] == heads // tp * D for g in got)


def test_qkv_refuses_kv_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="num_key_value_heads \\(2\\) must be divisible by tensor_parallel_size \\(4\\)"):
        QKVParallelLinear(8, 2, 4, 2, False, ParallelState(tp_rank=0, tp_size=4), F32, "cpu")


def test_loader_refuses_mis_shaped_tensors_and_unknown_shards():
    layer = QKVParallelLinear(4, 2, 2, 2, False, ParallelState(tp_rank=1, tp_size=2), F32, "cpu")
    with pytest.raises(ValueError, match="has shape \\(8, 4\\), the model expects \\(4, 4\\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(8, 4), "k")  # a doubled k is not sliced silently
    with pytest.raises(ValueError, match="unknown shard_id 'gate'"):
        layer.weight.weight_loader(layer.weight, torch.randn(4, 4), "gate")
    replicated = ReplicatedLinear(4, 3, False, ParallelState(), F32, "cpu")
    with pytest.raises(ValueError, match="the model expects \\(3, 4\\)"):
        replicated.weight.weight_loader(replicated.weight, torch.randn(4, 3))


@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_embedding_and_untied_head_shard_rows(tp):
    emb = [VocabParallelEmbedding(10, 3, p, F32, "cpu") for p in ranks(tp)]
    head = [ParallelLMHead(10, 3, p, F32, "cpu") for p in ranks(tp)]
    tied = [ParallelLMHead(10, 3, p, F32, "cpu", tied=e) for p, e in zip(ranks(tp), emb)]
    w = torch.randn(10, 3)
    load(emb, "weight", w)
    load(head, "weight", w)
    assert torch.equal(torch.cat([e.weight for e in emb]), w) and torch.equal(torch.cat([h.weight for h in head]), w)
    assert all(t.is_tied and t.weight is None and not list(t.parameters()) for t in tied)
    with pytest.raises(ValueError, match="vocab_size \\(10\\) must be divisible by tensor_parallel_size \\(3\\)"):
        VocabParallelEmbedding(10, 3, ParallelState(tp_rank=0, tp_size=3), F32, "cpu")


def _forward_worker(rank: int, world: int) -> dict:
    """Sharded column -> row MLP, embedding and head, against the full layers (same seed everywhere)."""
    parallel = ParallelState.from_torchrun(world)
    try:
        g = torch.Generator().manual_seed(0)
        w1, b1, w2, b2 = (torch.randn(s, generator=g) for s in ((12, 6), (12,), (6, 12), (6,)))
        emb_w, x = torch.randn(16, 6, generator=g), torch.randn(5, 6, generator=g)
        ids = torch.tensor([0, 15, 7, 8, 3])
        col = ColumnParallelLinear(6, 12, True, parallel, F32, "cpu")
        row = RowParallelLinear(12, 6, True, parallel, F32, "cpu")
        emb = VocabParallelEmbedding(16, 6, parallel, F32, "cpu")
        head = ParallelLMHead(16, 6, parallel, F32, "cpu", tied=emb)
        for param, full in ((col.weight, w1), (col.bias, b1), (row.weight, w2), (row.bias, b2), (emb.weight, emb_w)):
            param.weight_loader(param, full)
        ref_mlp = F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
        return {"mlp": (row(F.relu(col(x))) - ref_mlp).abs().max().item(),
                "embedding": torch.equal(emb(ids), F.embedding(ids, emb_w)),
                "logits": (head(x) - F.linear(x, emb_w)).abs().max().item(), "logits_shape": tuple(head(x).shape)}
    finally:
        parallel.destroy()


def test_sharded_layers_compute_the_full_layers_over_gloo():
    for got in run_ranks(_forward_worker, 2, timeout_s=60):
        assert got["mlp"] < 1e-5 and got["embedding"] and got["logits"] < 1e-5
        assert got["logits_shape"] == (5, 16)  # every rank holds the full vocabulary
