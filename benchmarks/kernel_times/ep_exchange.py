"""The expert-parallel MoE layer on N GPUs (NCCL): a Qwen3-30B-A3B layer (hidden 2048, 128 experts
split N ways, top-8, moe_intermediate 768, bf16, fused Triton experts) with T tokens on every rank,
timed with the all-gather exchange (eager and in a CUDA graph) and the all-to-all exchange (eager:
it syncs), next to the whole layer on one GPU (EP=1) running all ranks' tokens (N x T: the same
global batch). Spawns the ranks itself (one per GPU); NVLink multicast stays off. Times are rank
0's medians in us; every rank runs the same token count (the all-gather cost does not depend on
how many of the padded rows are real). The sharded layer against the full one:
tests/functional_tests/test_multigpu_ep_layer.py (``pytest -m multigpu``).

    python -m benchmarks kernel-times ep-exchange [--ep 2 4] [--tokens 8 64 256] [--iters 20]"""
from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from benchmarks.cuda_timing import graph_replay, median_ms
from megatron_async.config import ExpertExchange
from megatron_async.kernels.backends import KernelBackends
from megatron_async.models.layers.block import StepInputs
from megatron_async.parallel.state import ParallelState
from tests.helpers.moe_layers import QWEN3_30B_HIDDEN as HIDDEN, qwen3_30b_moe_layer
from tests.helpers.multiprocess import run_ranks

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@torch.no_grad()
def _worker(rank: int, world: int, tokens: list[int], iters: int) -> list[dict]:
    torch.cuda.set_device(rank)
    base = ParallelState.from_torchrun(1, "cuda", expert_parallel_size=world)
    try:
        layers = {e: qwen3_30b_moe_layer(dataclasses.replace(base, ep_exchange=e)) for e in ExpertExchange}
        single = qwen3_30b_moe_layer() if rank == 0 else None
        rows = []
        for T in tokens:
            x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
            step = StepInputs(None, None, None, ep_num_tokens=T, kernels=KernelBackends(attention="triton"))
            gather, a2a = layers[ExpertExchange.ALL_GATHER], layers[ExpertExchange.ALL_TO_ALL]
            row = {"tokens": T,
                   "all_gather_eager": 1e3 * median_ms(lambda: gather(x, step), iters),
                   "all_gather_graph": 1e3 * median_ms(graph_replay(lambda: gather(x, step), "thread_local"), iters),
                   "all_to_all_eager": 1e3 * median_ms(lambda: a2a(x, step), iters)}
            torch.distributed.barrier()
            if single is not None:  # one GPU with the whole batch of all ranks (the same global work)
                x_all = torch.randn(world * T, HIDDEN, device="cuda", dtype=torch.bfloat16)
                one = StepInputs(None, None, None, kernels=step.kernels)
                row["ep1_graph"] = 1e3 * median_ms(graph_replay(lambda: single(x_all, one)), iters)
            torch.distributed.barrier()
            rows.append(row)
        return rows
    finally:
        base.destroy()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--iters", type=int, default=20)


def run(args: argparse.Namespace) -> None:
    os.environ.update(NCCL_ENV)
    print(f"{'ep':>3}{'tokens/rank':>12}{'ag_eager_us':>13}{'ag_graph_us':>13}{'a2a_eager_us':>14}{'ep1_NxT_graph_us':>18}")
    for ep in args.ep:
        if torch.cuda.device_count() < ep:
            print(f"{ep:>3}  skipped: {torch.cuda.device_count()} GPUs")
            continue
        rows = run_ranks(_worker, ep, args.tokens, args.iters, timeout_s=500, env=NCCL_ENV)[0]
        for r in rows:
            print(f"{ep:>3}{r['tokens']:>12}{r['all_gather_eager']:>13.1f}{r['all_gather_graph']:>13.1f}"
                  f"{r['all_to_all_eager']:>14.1f}{r['ep1_graph']:>18.1f}")
