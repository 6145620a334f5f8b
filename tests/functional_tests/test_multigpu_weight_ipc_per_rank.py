"""Per-rank CUDA IPC refit on 4 GPUs (tests/helpers/refit_per_rank.py): a TP=4 trainer (4
processes, GPU r each, Megatron-Core names, a storage per tensor) shares its shards with
``ipc.Sharer`` addressed to the engine rank on its GPU; a TP=4 engine (4 processes, NCCL among
them) maps on each rank only the storages of its own GPU's trainer rank (a payload naming another
GPU is refused) and generates the tokens of the same weights given in-process, after an update and
after the trainer's in-place change (the same payload: nothing mapped again)."""
import pytest
import torch

from tests.helpers.multiprocess import free_port, run_ranks
from tests.helpers.refit_per_rank import per_rank_refit

pytestmark = pytest.mark.multigpu
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.gpus(4)
def test_tp4_trainer_refits_a_tp4_engine_one_payload_per_rank():
    out = run_ranks(per_rank_refit, 8, free_port(), "cuda", timeout_s=200, env=ENV)
    trainers, engines = out[:4], out[4:]
    assert all(t["same_payload"] and t["shared"] == t["storages"] for t in trainers), trainers
    for got, trainer in zip(engines, trainers):
        assert (got["version1"], got["version2"]) == (1, 2)
        assert "names GPU" in got.get("other_gpu", ""), got  # refused before anything was mapped
        assert got["opened1"] == got["opened2"] == trainer["segments"]
        assert got["tokens1"] == got["want1"] and got["tokens2"] == got["want2"], got
        assert got["tokens1"] != got["tokens2"]
    assert all(e["tokens2"] == engines[0]["tokens2"] for e in engines)
