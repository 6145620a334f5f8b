"""ParallelState: this process's ranks, sizes and process groups, created once by ``LLM`` and
passed to every model and layer that shards or communicates (no module globals).

Tensor parallelism (tp) splits heads, MLP / Mamba columns and the vocabulary; activations are
all-reduced over ``tp_group``. Expert parallelism (ep) and attention data parallelism (dp) are
reserved for the MoE issue: experts split over ``ep_size`` ranks while each dp rank runs its
own requests. Today ep_size = dp_size = 1, so the world is the TP group."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    """torch.distributed process group of the TP ranks (None when tp_size is 1, or in tests
    that only load weights as rank ``tp_rank``: loading needs no communication)."""
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Any = None
    """Reserved: the expert-parallel group (MoE experts split ``ep_size`` ways)."""
    dp_rank: int = 0
    dp_size: int = 1
    """Reserved: attention data parallelism (each dp rank an engine with its own requests)."""

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank {rank} / {name}_size {size}: need size >= 1 and 0 <= rank < size")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.ep_size

    @property
    def is_leader(self) -> bool:
        """The rank that accepts requests, prints and writes (global rank 0)."""
        return self.tp_rank == 0 and self.ep_rank == 0

    def tp_divide(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, columns, vocabulary rows); a clear error when
        it does not divide. Raised while the model is built, identically on every rank."""
        if total % self.tp_size:
            raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({self.tp_size})")
        return total // self.tp_size

    @classmethod
    def from_torchrun(cls, tensor_parallel_size: int, device: torch.device | str = "cpu",
                      expert_parallel_size: int = 1) -> ParallelState:
        """Join the torchrun job described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as a
        TP group of ``tensor_parallel_size`` ranks, or as ``expert_parallel_size`` data-parallel
        engines (one EP group; TP x EP is not supported yet) (NCCL on CUDA, gloo on CPU). Size 1
        needs no environment and creates no group."""
        if tensor_parallel_size < 1 or expert_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) and expert_parallel_size "
                             f"({expert_parallel_size}) must be >= 1")
        if tensor_parallel_size > 1 and expert_parallel_size > 1:
            raise ValueError("tensor and expert parallelism together are not supported yet")
        if expert_parallel_size > 1:
            rank, world = cls._join(expert_parallel_size, "expert_parallel_size", device)
            return cls(ep_rank=rank, ep_size=world, ep_group=dist.group.WORLD, dp_rank=rank, dp_size=world)
        if tensor_parallel_size == 1:
            return cls()
        rank, world = cls._join(tensor_parallel_size, "tensor_parallel_size", device)
        return cls(tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD)

    @staticmethod
    def _join(size: int, what: str, device: torch.device | str) -> tuple[int, int]:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"{what}={size} needs a torchrun environment; unset: {', '.join(missing)}")
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"{what}={size} but WORLD_SIZE={world}; launch exactly that many processes")
        if not dist.is_initialized():
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=world)
        elif dist.get_world_size() != world:
            raise RuntimeError(f"torch.distributed is already initialised with world size {dist.get_world_size()}")
        return dist.get_rank(), world

    @property
    def rank(self) -> int:
        """Global rank (ranks are laid out TP-major inside each EP rank)."""
        return self.ep_rank * self.tp_size + self.tp_rank

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def rendezvous_store(self):
        """The job's torch.distributed store (the torchrun rendezvous): ranks publish addresses in it."""
        return dist.distributed_c10d._get_default_store()

    def destroy(self) -> None:
        """Leave the process groups (tests run several TP jobs in one process's lifetime)."""
        if (self.tp_group is not None or self.ep_group is not None) and dist.is_initialized():
            dist.destroy_process_group()
