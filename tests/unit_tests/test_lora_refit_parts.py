"""The pieces of an adapter's refit without processes: a manifest's buckets (tensors in row pieces,
TP shards) gathered back into whole tensors grouped by shard as ``update_lora`` takes them; a
count that disagrees with the manifest fails; names that are no adapter's are refused."""
from __future__ import annotations

import pytest
import torch

from megatron_async.inference.engines.lora_refit import GatheredTensors, _check_names, adapter_source
from megatron_async.models.lora import LoRAError
from megatron_async.weight_transfer import Shard, TransferFailed, build_manifest

A = "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"
B = "decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight"


def _items():
    gen = torch.Generator().manual_seed(0)
    return [(name, torch.randn(shape, generator=gen), Shard(r, 2))
            for r in range(2) for name, shape in ((A, (2, 16)), (B, (40, 4)))]


def _gather(items, bucket_bytes: int):
    manifest = build_manifest(items, bucket_bytes)
    gathered = GatheredTensors(manifest, torch.device("cpu"))
    gathered.begin()
    index, copied = 0, 0
    for b in manifest.buckets:
        flat = torch.zeros(b.nbytes, dtype=torch.uint8)
        for e in b.tensors:  # what the sender puts in the bucket
            t = next(t for n, t, s in items if (n, s) == (e.name, e.shard))
            t = t if e.rows is None else t[e.rows[0]: e.rows[1]]
            flat[e.offset: e.offset + e.nbytes] = t.contiguous().view(-1).view(torch.uint8)
        copied += gathered.run([(index + i, flat[e.offset: e.offset + e.nbytes].view(e.torch_dtype).view(e.piece_shape))
                                for i, e in enumerate(b.tensors)])
        index += len(b.tensors)
    return manifest, gathered, copied


def test_pieces_and_shards_come_back_whole():
    items = _items()
    manifest, gathered, copied = _gather(items, 256)
    assert any(e.rows is not None for e in manifest.entries())  # some tensors travelled in pieces
    gathered.finish(copied)
    source = gathered.source()
    assert [s for _, s in source] == [Shard(0, 2), Shard(1, 2)]
    for tensors, shard in source:
        for name, t, s in items:
            if s == shard:
                assert torch.equal(tensors[name], t)
    with pytest.raises(TransferFailed, match="arrived"):
        gathered.finish(copied - 1)


def test_whole_tensors_make_one_mapping():
    t = torch.ones(2, 3)
    assert adapter_source([("m.q_proj.lora_A.weight", Shard(), t)]) == {"m.q_proj.lora_A.weight": t}


def test_names_that_are_no_adapters_are_refused():
    _check_names([A, B, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])
    with pytest.raises(LoRAError, match="not LoRA adapter tensors"):
        _check_names([A, "decoder.layers.0.self_attention.linear_qkv.weight"])
