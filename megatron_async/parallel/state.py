"""Tensor-parallel process group: one group spanning every rank of a torchrun job.

Without ``init_tensor_parallel`` (or with tp_size 1) the size is 1 and there is no group,
so single-process code never touches torch.distributed."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

_group: dist.ProcessGroup | None = None
_rank = 0
_size = 1


def init_tensor_parallel(tp_size: int, device: torch.device | str = "cpu") -> None:
    """Join the torchrun job described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as a
    TP group of ``tp_size`` ranks (NCCL on CUDA, gloo on CPU). The whole world is the TP
    group: there is no data or pipeline parallelism."""
    global _group, _rank, _size
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"tensor_parallel_size={tp_size} needs a torchrun environment; unset: {', '.join(missing)}")
    world = int(os.environ["WORLD_SIZE"])
    if world != tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} but WORLD_SIZE={world}; launch exactly tp_size processes")
    if _group is not None:
        if _size != tp_size:
            raise RuntimeError(f"tensor parallelism already initialised with size {_size}")
        return
    is_cuda = torch.device(device).type == "cuda"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if is_cuda else "gloo", rank=int(os.environ["RANK"]), world_size=world)
    _group, _rank, _size = dist.group.WORLD, dist.get_rank(), world


def destroy_tensor_parallel() -> None:
    """Leave the group (tests run several TP jobs in one process's lifetime)."""
    global _group, _rank, _size
    if _group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _group, _rank, _size = None, 0, 1


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def tp_group() -> dist.ProcessGroup | None:
    return _group
