"""Bucketed weight transfer over a gloo transfer group (CPU processes): a trainer's TP ranks send
their Megatron-Core shards, engine ranks of another TP size copy each bucket into place; one
bucket buffer beyond the model per rank (a TP=2 trainer's shards resliced for a TP=4 engine too); a refusal stops everyone before any byte moves; a
bucket skipped or applied twice fails the end frame on every rank."""
import pytest

from megatron_async.weight_transfer import Manifest
from tests.helpers.multiprocess import free_port, run_ranks
from tests.helpers.refit_transfer import manifests, transfer_rank

BUCKET = 8 << 10  # 8 KiB: many buckets, the embedding in row pieces


def _run(kind, trainer_tp, engine_tp, plant=None):
    return run_ranks(transfer_rank, trainer_tp + engine_tp, free_port(), "gloo", kind, trainer_tp, engine_tp,
                     BUCKET, plant, timeout_s=120)


@pytest.mark.parametrize("kind,trainer_tp,engine_tp", [("dense", 2, 2), ("dense", 4, 1), ("dense", 1, 2),
                                                       ("dense_tp4", 2, 4), ("hybrid", 2, 1)])
def test_trainer_shards_reach_every_engine_rank(kind, trainer_tp, engine_tp):
    out = _run(kind, trainer_tp, engine_tp)
    manifest = manifests(kind, trainer_tp, BUCKET)[1]
    assert len(manifest.buckets) > 4 and manifest.max_bucket_bytes <= BUCKET
    assert any(e.rows is not None for e in manifest.entries())  # a tensor travelled in pieces
    assert out[:trainer_tp] == ["sent"] * trainer_tp
    for equal, untouched, buffer_bytes, error in out[trainer_tp:]:
        assert error is None and equal and not untouched
        assert buffer_bytes == manifest.max_bucket_bytes  # one bucket beyond the model


@pytest.mark.parametrize("plant", ["skip", "twice"])
def test_a_bucket_skipped_or_applied_twice_fails_every_rank(plant):
    out = _run("dense", 2, 2, plant)
    assert all(s.startswith("failed: an engine rank did not complete") for s in out[:2]), out[:2]
    assert "this engine rank did not complete" in out[2][3]
    assert "another engine rank did not complete" in out[3][3]


@pytest.mark.parametrize("plant,message", [("unknown", "Refused: weight update refused, nothing was changed: unknown Megatron-Core tensors"),
                                           ("digest", "TransferFailed: refused before any bucket moved")])
def test_refusals_stop_everyone_before_any_byte_moves(plant, message):
    out = _run("dense", 2, 2, plant)
    assert all(s.startswith("failed: the update was refused before any bucket moved") for s in out[:2]), out[:2]
    for equal, untouched, _, error in out[2:]:
        assert untouched and message in error, error


def test_manifest_json_round_trip_is_what_the_ranks_hash():
    manifest = manifests("dense", 2, BUCKET)[1]
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest and again.digest() == manifest.digest()
