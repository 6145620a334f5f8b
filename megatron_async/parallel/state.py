"""ParallelState: this process's ranks, sizes and process groups, created once by ``LLM`` and
passed to every model and layer that shards or communicates (no module globals).

Tensor parallelism (tp) splits heads, MLP / Mamba columns and the vocabulary; activations are
all-reduced over ``tp_group``. Expert parallelism (ep) splits the routed experts of MoE layers
over ``ep_size`` ranks, whose attention is data parallel: each ep rank is also a dp rank
(dp_rank == ep_rank) running its own requests, and MoE layers exchange tokens over
``ep_group``. A world of T x E ranks is E data-parallel replicas of a T-way TP group: global
rank = ep_rank * T + tp_rank; the TP group is a replica's T consecutive ranks, the EP group
the E ranks with the same tp_rank (experts are also TP-split inside each ep rank)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_async.config import ExpertExchange


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
    """torch.distributed group of the ranks that share routed experts (same tp_rank, one per
    data-parallel replica); None when ep_size is 1 or in loading-only tests."""
    ep_exchange: ExpertExchange = ExpertExchange.ALL_GATHER
    """The MoE token exchange over ``ep_group`` (``parallel/communication.py``)."""
    dp_rank: int = 0
    dp_size: int = 1
    """Attention data parallelism: each dp rank is an engine with its own requests. Equal to
    (ep_rank, ep_size) when built by ``from_torchrun``."""
    tp_reducer: Any = None
    """The TP group's P2P all-reduce for small messages (``parallel/p2p_all_reduce.py``,
    attached by ``with_p2p_all_reduce``); None: the process group's collective for every size."""
    ep_exchanger: Any = None
    """The EP group's P2P all-gather / reduce-scatter for small messages (``parallel/p2p_exchange.py``,
    attached by ``with_p2p_exchange``); None: the process group's collectives."""

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

    @property
    def global_rank(self) -> int:
        return self.ep_rank * self.tp_size + self.tp_rank

    def ep_divide(self, total: int, what: str) -> int:
        """This rank's number of ``total`` experts; a clear error when it does not divide."""
        if total % self.ep_size:
            raise ValueError(f"{what} ({total}) must be divisible by expert_parallel_size ({self.ep_size})")
        return total // self.ep_size

    def tp_divide(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, columns, vocabulary rows); a clear error when
        it does not divide. Raised while the model is built, identically on every rank."""
        if total % self.tp_size:
            raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({self.tp_size})")
        return total // self.tp_size

    @classmethod
    def from_torchrun(cls, tensor_parallel_size: int, device: torch.device | str = "cpu",
                      expert_parallel_size: int = 1,
                      ep_exchange: ExpertExchange | str = ExpertExchange.ALL_GATHER) -> ParallelState:
        """Join the torchrun job described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as
        ``expert_parallel_size`` data-parallel replicas of a ``tensor_parallel_size``-way TP
        group (NCCL on CUDA, gloo on CPU; WORLD_SIZE must be their product). Sizes 1 x 1 need
        no environment and create no group. Every rank creates every group, in one order."""
        for name, size in (("tensor_parallel_size", tensor_parallel_size), ("expert_parallel_size", expert_parallel_size)):
            if size < 1:
                raise ValueError(f"{name} must be >= 1, got {size}")
        want = tensor_parallel_size * expert_parallel_size
        if want == 1:
            return cls()
        what = f"tensor_parallel_size={tensor_parallel_size} x expert_parallel_size={expert_parallel_size}"
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"{what} needs a torchrun environment; unset: {', '.join(missing)}")
        world = int(os.environ["WORLD_SIZE"])
        if world != want:
            raise ValueError(f"{what} needs WORLD_SIZE={want}, got {world}; launch exactly that many processes")
        if not dist.is_initialized():
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=world)
        elif dist.get_world_size() != world:
            raise RuntimeError(f"torch.distributed is already initialised with world size {dist.get_world_size()}")
        rank, T, E = dist.get_rank(), tensor_parallel_size, expert_parallel_size
        tp_rank, ep_rank = rank % T, rank // T
        if E == 1:
            return cls(tp_rank=tp_rank, tp_size=T, tp_group=dist.group.WORLD)
        exchange = ExpertExchange(ep_exchange)
        if T == 1:
            return cls(ep_rank=ep_rank, ep_size=E, ep_group=dist.group.WORLD, ep_exchange=exchange,
                       dp_rank=ep_rank, dp_size=E)
        tp_group = ep_group = None
        for e in range(E):  # new_group is collective: all ranks create all groups in one order
            g = dist.new_group([e * T + t for t in range(T)])
            tp_group = g if e == ep_rank else tp_group
        for t in range(T):
            g = dist.new_group([e * T + t for e in range(E)])
            ep_group = g if t == tp_rank else ep_group
        return cls(tp_rank=tp_rank, tp_size=T, tp_group=tp_group, ep_rank=ep_rank, ep_size=E, ep_group=ep_group,
                   ep_exchange=exchange, dp_rank=ep_rank, dp_size=E)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def connect(self, device: torch.device) -> None:
        """The job's first collective, on its default group (NCCL creates its communicator there):
        the start-up reports it apart from the P2P set-up that follows."""
        flag = torch.ones(1, device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag)

    def rendezvous_store(self):
        """The job's torch.distributed store (the torchrun rendezvous): ranks publish addresses in it."""
        return dist.distributed_c10d._get_default_store()

    def destroy(self) -> None:
        """Leave the process groups (tests run several parallel jobs in one process's lifetime)."""
        for p2p in (self.tp_reducer, self.ep_exchanger):
            if p2p is not None:
                p2p.close()
        if (self.tp_group is not None or self.ep_group is not None) and dist.is_initialized():
            dist.destroy_process_group()
