"""The P2P all-reduce (torch symmetric memory, no multicast) on 2 / 4 GPUs (``pytest -m
multigpu``; skipped below 2 CUDA devices): fp32 / bf16 sums equal NCCL within rounding on fresh
random data, every rank gets the same bits, sizes and dtypes it must not take go to NCCL, a CUDA
graph holding one-shot, two-shot and NCCL all-reduces replays correctly on new inputs; the
all-reduce fused with add + RMSNorm equals the unfused path (fp32 within 1e-6, the new residual
bit for bit; bf16 within rounding), identical on every rank, and replays in a graph; and the
engine under TP with CUDA graphs on P2P (fused norm on and off) gives TP=1's tokens (fp32), with
P2P and fused calls counted.
``python -m benchmarks all-reduce`` runs the same checks before timing."""
from __future__ import annotations

import pytest
import torch

from megatron_async import LLM, InferenceConfig
from tests.helpers.all_reduce_checks import (
    ENGINE_CONFIG, NO_MULTICAST_ENV, all_reduce_worker, assert_group_report, engine_outputs, engine_worker)
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.helpers.multiprocess import run_ranks

pytestmark = [pytest.mark.multigpu, pytest.mark.gpus(2, up_to=4)]


def test_p2p_all_reduce_equals_nccl():
    world = 4 if torch.cuda.device_count() >= 4 else 2
    groups = sorted({world, 2}, reverse=True)
    reports = run_ranks(all_reduce_worker, world, groups, [], 0, timeout_s=300, env=NO_MULTICAST_ENV)
    for g in groups:
        for rank in range(g):
            assert_group_report(reports[rank][g])


@pytest.mark.parametrize("backend", ["p2p", "p2p-unfused", "nccl"])
def test_fp32_tp_graphs_tokens_equal_tp1(tmp_path, backend):
    world = 4 if torch.cuda.device_count() >= 4 else 2
    ckpt = str(make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "qwen3", num_attention_heads=8,
                                    num_key_value_heads=4))
    expected = engine_outputs(LLM(ckpt, device="cuda", dtype="float32", inference_config=InferenceConfig(**ENGINE_CONFIG)))
    fused = backend == "p2p"
    ranks = run_ranks(engine_worker, world, ckpt, backend.split("-")[0], fused, timeout_s=240, env=NO_MULTICAST_ENV)
    for rank, got in enumerate(ranks):
        assert got["outputs"] == expected, f"rank {rank}"
        assert got["graph_replays"] > 0
        calls = got["p2p_calls"]
        assert bool(calls.get("one_shot")) == (backend != "nccl"), calls  # the LM head / embedding still all-reduce
        assert bool(calls.get("fused_norm")) == fused, calls
        assert got["fused_on"] == fused, got  # the fused path passed its self-test: not the unfused fall-back
