"""The bucketed transfer over NCCL (the code the gloo tests run on CPU): trainer ranks send their
Megatron-Core shards from their GPUs, engine ranks on other GPUs copy each bucket into place,
resliced for the engine's TP size; a bucket skipped fails every rank. One GPU per rank (NCCL takes
no two ranks of one group on one GPU): 2 GPUs give trainer TP 1 -> engine TP 1, 4 give TP 2 -> TP 2,
6 give TP 2 -> TP 4."""
import os

import pytest
import torch

from tests.helpers.multiprocess import free_port, run_ranks
from tests.helpers.refit_transfer import manifests, transfer_rank

pytestmark = pytest.mark.multigpu
BUCKET = 8 << 10


def _sizes() -> tuple[int, int]:
    half = min(4, torch.cuda.device_count()) // 2
    return half, half


def _run(plant=None, sizes=None, kind="dense"):
    trainer, engine = sizes or _sizes()
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
    return run_ranks(transfer_rank, trainer + engine, free_port(), "nccl", kind, trainer, engine, BUCKET, plant,
                     timeout_s=300, env=env), trainer


def _check_filled(out, trainer, kind="dense"):
    assert out[:trainer] == ["sent"] * trainer
    manifest = manifests(kind, trainer, BUCKET)[1]
    for equal, untouched, buffer_bytes, error in out[trainer:]:
        assert error is None and equal and not untouched and buffer_bytes == manifest.max_bucket_bytes


def test_nccl_transfer_fills_every_engine_rank():
    _check_filled(*_run())


@pytest.mark.gpus(6)  # a TP=2 trainer and a TP=4 engine
def test_nccl_transfer_reslices_a_tp2_trainer_for_a_tp4_engine():
    _check_filled(*_run(sizes=(2, 4), kind="dense_tp4"), kind="dense_tp4")


def test_nccl_bucket_skipped_fails_every_rank():
    out, trainer = _run("skip")
    assert all(s.startswith("failed: an engine rank did not complete") for s in out[:trainer]), out
    assert "this engine rank did not complete" in out[trainer][3]
