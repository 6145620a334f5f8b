"""The expert-parallel MoE layer on 2 / 4 GPUs over NCCL (``pytest -m multigpu``; skipped below
2 CUDA devices): float32, each rank with its own token count (one with none), the sharded layer
equals the full layer with the all-gather and the all-to-all exchange (fused Triton experts);
the all-gather layer replays in a CUDA graph (no host sync, fixed shapes) with the result of an eager call."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.cuda_timing import capture
from megatron_async.config import ExpertExchange
from megatron_async.kernels.backends import KernelBackends
from megatron_async.models.layers.block import StepInputs
from megatron_async.parallel.state import ParallelState
from tests.helpers.moe_layers import MOE_CONFIGS, build_moe_layer
from tests.helpers.multiprocess import run_ranks

pytestmark = pytest.mark.multigpu

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
HIDDEN = 64
TRITON = KernelBackends(attention="triton")  # the fused MoE kernels (the torch loop syncs: not capturable)


def _worker(rank: int, world: int) -> dict:
    torch.cuda.set_device(rank)
    base = ParallelState.from_torchrun(1, "cuda", expert_parallel_size=world)
    try:
        errors = {}
        counts = [7, 0, 3, 12][:world]
        for kind, cfg in MOE_CONFIGS.items():
            full = build_moe_layer(cfg, HIDDEN, ParallelState(), device="cuda")
            x = torch.randn(counts[rank], HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
            step = StepInputs(None, None, None, ep_num_tokens=max(counts), kernels=TRITON)
            full_step = StepInputs(None, None, None, kernels=TRITON)
            for exchange in ExpertExchange:
                layer = build_moe_layer(cfg, HIDDEN, dataclasses.replace(base, ep_exchange=exchange), device="cuda")
                out = layer(x, step)
                errors[f"{kind}_{exchange.value}"] = float((out - full(x, full_step)).abs().max()) if x.numel() else 0.0
        # graph replay of the all-gather layer: capture on every rank, new tokens, replay
        layer = build_moe_layer(MOE_CONFIGS["softmax"], HIDDEN, base, device="cuda")
        x = torch.zeros(max(counts), HIDDEN, device="cuda")
        step = StepInputs(None, None, None, ep_num_tokens=max(counts), kernels=TRITON)
        # thread_local: NCCL's watchdog thread polls events during the capture ("global" mode
        # would fail the capture on whichever rank it hits first, and the other rank would hang)
        graph, out = capture(lambda: layer(x, step), error_mode="thread_local")
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(10 + rank)))
        graph.replay()
        torch.cuda.synchronize()
        errors["graph_replay"] = float((out - layer(x, step)).abs().max())
        del graph  # before destroy_process_group: ncclCommDestroy waits for graphs holding NCCL ops
        return errors
    finally:
        base.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_ep_moe_layer_on_nccl_equals_the_full_layer(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    for errors in run_ranks(_worker, world, timeout_s=300, env=NCCL_ENV):
        assert max(errors.values()) < 1e-4, errors
