"""Per-rank IPC refit on CPU (shared memory, spawned processes, tests/helpers/refit_per_rank.py): a
TP=2 trainer's ranks each share their Megatron-Core shards, replicated copies included, addressed
to the engine rank on their device; a TP=2 engine's ranks each map only their own payload's
storages, take the replicated copies from it, and generate the tokens of the same weights given
in-process, after an update and after the trainer's in-place change (whose payload is the same
text: nothing checked or mapped again)."""
from tests.helpers.multiprocess import free_port, run_ranks
from tests.helpers.refit_per_rank import per_rank_refit


def test_each_engine_rank_takes_its_own_trainer_rank_payload():
    out = run_ranks(per_rank_refit, 4, free_port(), "cpu", timeout_s=400)
    trainers, engines = out[:2], out[2:]
    assert all(t["same_payload"] and t["shared"] == t["storages"] for t in trainers), trainers
    for got, trainer in zip(engines, trainers):
        assert (got["version1"], got["version2"]) == (1, 2)
        assert got["opened1"] == got["opened2"] == trainer["segments"]  # its own payload's segments, once
        misses, hits, reused = got["plans"]  # (a rank whose shard the engine planned at start takes that plan)
        assert got["unchanged"] >= 1 and (misses + reused, hits) == (1, 1)
        assert got["tokens1"] == got["want1"] and got["tokens2"] == got["want2"], got
        assert got["tokens1"] != got["tokens2"]  # the in-place change arrived
    assert engines[0]["tokens2"] == engines[1]["tokens2"]
