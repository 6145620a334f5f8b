"""The transfer manifest: JSON round trip and digest, strict parsing (every malformed field a
ManifestError), bucket packing (no bucket over its size, big tensors in row pieces that cover them
exactly once), merging senders' manifests; the package imports nothing of the engine."""
import json
import subprocess
import sys

import pytest
import torch

from megatron_async.weight_transfer import Manifest, ManifestError, Shard, build_manifest, merge


def _items():
    return [("embedding.word_embeddings.weight", torch.zeros(100, 16), Shard(tp_rank=1, tp_size=2)),
            ("decoder.final_layernorm.weight", torch.zeros(16, dtype=torch.bfloat16), None),
            ("decoder.layers.0.mlp.linear_fc2.weight", torch.zeros(16, 48), Shard(tp_rank=1, tp_size=2, layer_offset=3))]


def test_packing_round_trip_and_pieces():
    m = build_manifest(_items(), bucket_bytes=2048, src=1, version=4)
    assert m.max_bucket_bytes <= 2048 and all(b.src == 1 for b in m.buckets)
    pieces = [e for e in m.entries() if e.name == "embedding.word_embeddings.weight"]
    assert len(pieces) > 1 and [e.rows for e in pieces][0][0] == 0
    covered = sorted(r for e in pieces for r in range(*e.rows))
    assert covered == list(range(100))  # every row exactly once
    assert pieces[0].shard == Shard(tp_rank=1, tp_size=2)
    again = Manifest.from_json(json.loads(m.to_json()))
    assert again == m and again.digest() == m.digest()
    assert Manifest.from_json(m.to_json().replace('"version":4', '"version":5')).digest() != m.digest()
    for b in m.buckets:
        spans = sorted((e.offset, e.offset + e.nbytes) for e in b.tensors)
        assert all(a[1] <= c[0] for a, c in zip(spans, spans[1:])) and all(o % 64 == 0 for o, _ in spans)


def test_merge_keeps_each_senders_buckets():
    a = build_manifest(_items()[:1], 4096, src=0, version=1)
    b = build_manifest(_items()[1:], 4096, src=1, version=1)
    m = merge([a, b.to_json()])
    assert [x.src for x in m.buckets] == [0] * len(a.buckets) + [1] * len(b.buckets)
    with pytest.raises(ManifestError, match="same weights_format and version"):
        merge([a, build_manifest(_items()[1:], 4096, src=1, version=2)])


def _base() -> dict:
    return json.loads(build_manifest(_items(), 2048).to_json())


@pytest.mark.parametrize("mutate,message", [
    (lambda m: m.update(weights_format="torch"), "weights_format"),
    (lambda m: m.update(version=-1), "version"),
    (lambda m: m.update(buckets={}), "buckets must be a list"),
    (lambda m: m["buckets"][0].update(nbytes=8), "beyond its bucket"),
    (lambda m: m["buckets"][0]["tensors"][0].update(offset=3), "multiple of 64"),
    (lambda m: m["buckets"][0]["tensors"][0].update(dtype="int64"), "dtype"),
    (lambda m: m["buckets"][0]["tensors"][0].update(shape="x"), "shape must be a list"),
    (lambda m: m["buckets"][0]["tensors"][0].update(rows=[5, 2]), "rows"),
    (lambda m: m["buckets"][0]["tensors"][0].update(tp_rank=2), "tp_rank"),
    (lambda m: m["buckets"][0]["tensors"][0].update(evil=1), "unknown fields"),
    (lambda m: m["buckets"][0]["tensors"].append(dict(m["buckets"][0]["tensors"][0])), "overlap"),
    (lambda m: m["buckets"][0].update(src=True), "src"),
])
def test_malformed_manifests_are_refused(mutate, message):
    m = _base()
    mutate(m)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(m)
    with pytest.raises(ManifestError):
        Manifest.from_json(b"{not json")


def test_the_sender_side_imports_no_engine():
    code = ("import sys, megatron_async.weight_transfer as wt; "
            "bad = [m for m in sys.modules if m.startswith(('megatron_async.inference', 'megatron_async.serve', "
            "'megatron_async.llm'))]; print(bad); assert not bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
