"""The expert-parallel MoE layer on 2 / 4 GPUs over NCCL (``pytest -m multigpu``; skipped below
2 CUDA devices): float32, each rank with its own token count (one with none), the sharded layer
equals the full layer with the all-gather and the all-to-all exchange (fused Triton experts);
the all-gather layer replays in a CUDA graph (no host sync, fixed shapes) with the result of an
eager call, also with fewer rows than the ranks agreed on. At the Qwen3-30B-A3B layer (bf16, 8 /
64 / 256 tokens a rank) both exchanges and the all-gather graph stay within 3e-2 of the one-GPU
layer. Under all of it: NCCL's all-gather and reduce-scatter captured in a CUDA graph replay on
new data. A hang dumps each rank's stack before its deadline; to tell an NCCL feature from our
own bug, run again with ``NCCL_GRAPH_REGISTER=0 NCCL_RUNTIME_CONNECT=0`` (the ranks inherit the
environment). Times: ``python -m benchmarks kernel-times ep-exchange``."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.cuda_timing import capture
from megatron_async.config import ExpertExchange
from megatron_async.kernels.backends import KernelBackends
from megatron_async.models.layers.block import StepInputs
from megatron_async.parallel.state import ParallelState
from tests.helpers.moe_layers import MOE_CONFIGS, QWEN3_30B_HIDDEN, build_moe_layer, qwen3_30b_moe_layer
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
        # fewer rows than the agreed count: padding rows ride along in the captured exchange
        x = torch.zeros(5, HIDDEN, device="cuda")
        padded = StepInputs(None, None, None, ep_num_tokens=8, kernels=TRITON)
        graph, out = capture(lambda: layer(x, padded), error_mode="thread_local")
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(20 + rank)))
        graph.replay()
        torch.cuda.synchronize()
        errors["graph_replay_padded"] = float((out - layer(x, padded)).abs().max())
        del graph
        return errors
    finally:
        base.destroy()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.gpus(4))])
def test_ep_moe_layer_on_nccl_equals_the_full_layer(world):
    for errors in run_ranks(_worker, world, timeout_s=300, env=NCCL_ENV):
        assert max(errors.values()) < 1e-4, errors


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def _qwen3_30b_worker(rank: int, world: int, tokens: list[int]) -> dict:
    torch.cuda.set_device(rank)
    base = ParallelState.from_torchrun(1, "cuda", expert_parallel_size=world)
    try:
        full = qwen3_30b_moe_layer()
        layers = {e: qwen3_30b_moe_layer(dataclasses.replace(base, ep_exchange=e)) for e in ExpertExchange}
        gather, errors = layers[ExpertExchange.ALL_GATHER], {}
        full_step = StepInputs(None, None, None, kernels=TRITON)
        gen = torch.Generator("cuda").manual_seed(rank)
        with torch.no_grad():
            for T in tokens:
                x = torch.randn(T, QWEN3_30B_HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
                step = StepInputs(None, None, None, ep_num_tokens=T, kernels=TRITON)
                for exchange, layer in layers.items():
                    errors[f"{T}_{exchange.value}"] = _relative(layer(x, step), full(x, full_step))
                graph, out = capture(lambda: gather(x, step), error_mode="thread_local")
                x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
                graph.replay()
                torch.cuda.synchronize()
                errors[f"{T}_graph_replay"] = _relative(out, full(x, full_step))
                del graph
        return errors
    finally:
        base.destroy()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.gpus(4))])
def test_ep_moe_layer_at_the_qwen3_30b_shape(world):
    for errors in run_ranks(_qwen3_30b_worker, world, [8, 64, 256], timeout_s=300, env=NCCL_ENV):
        assert max(errors.values()) < 3e-2, errors


def _exchange(x: torch.Tensor, world: int) -> torch.Tensor:
    gathered = torch.empty((world * x.shape[0], x.shape[1]), device=x.device, dtype=x.dtype)
    torch.distributed.all_gather_into_tensor(gathered, x)
    out = torch.empty_like(x)
    torch.distributed.reduce_scatter_tensor(out, gathered * 2)
    return out


def _nccl_capture_worker(rank: int, world: int) -> float:
    torch.cuda.set_device(rank)
    base = ParallelState.from_torchrun(1, "cuda", expert_parallel_size=world)
    try:
        x = torch.randn(8, 64, device="cuda")
        graph, out = capture(lambda: _exchange(x, world), error_mode="thread_local")  # eager warm-up first
        err = 0.0
        for i in range(3):
            x.copy_(torch.randn(8, 64, device="cuda") + i)
            graph.replay()
            torch.cuda.synchronize()
            err = max(err, float((out - _exchange(x, world)).abs().max()))
        del graph
        return err
    finally:
        base.destroy()


def test_nccl_collectives_replay_in_a_cuda_graph():
    """all_gather_into_tensor + reduce_scatter_tensor captured in one graph on both ranks, replayed
    on new data: NCCL capture itself works (what the EP graphs above stand on)."""
    assert max(run_ranks(_nccl_capture_worker, 2, timeout_s=60, env=NCCL_ENV)) < 1e-4
