"""Ranks of one host build each Triton kernel once, not once per rank.

Under expert parallelism every rank of a host starts at the same moment and its dry pass
records nearly the same kernels (``triton_builds.deferring``); the ranks share Triton's on-disk
cache (``triton_builds.cache_dir()``), so one compile serves them all. Each recorded
specialization has an owner among the host's ranks, a hash of the kernel's name and
specialization data modulo the host's rank count: the same owner on every rank whatever else
each list holds, so lists that differ slightly (a rank-valued argument specializes differently
on rank 1) change nothing for the kernels they share. A rank first builds the kernels it owns
(``triton_builds.build_all`` with a ``HostShare``), then waits for every rank at a barrier,
then builds the rest, each a load from the cache; a kernel whose owner did not record it (or
failed to build it) is compiled there by the rank that needs it, so no rank ever depends on
another's list. The barrier is a one-element all-reduce over the job's process group: every
rank reaches it once per build (build_all calls it even with nothing to build or after a
failed build), while no other collective is in flight."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Callable


def spec_key(jit, data: str) -> str:
    """A specialization's name, equal on every rank: the kernel's module and qualified name, and
    Triton's serialized specialization data."""
    fn = getattr(jit, "fn", None)
    return f"{getattr(jit, 'module', '?')}:{getattr(fn, '__qualname__', '?')}\n{data}"


def owner(key: str, count: int) -> int:
    """Which of ``count`` ranks builds ``key`` first."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % count


@dataclass(frozen=True)
class HostShare:
    """This rank's part of its host's builds: rank ``index`` of ``count``, ``barrier`` meeting
    every rank of the job."""

    index: int
    count: int
    barrier: Callable[[], None]

    def mine(self, jit, data: str) -> bool:
        return owner(spec_key(jit, data), self.count) == self.index

    def split(self, specs: list) -> tuple[list, list]:
        """(the specializations this rank builds first, the rest)."""
        first = [s for s in specs if self.mine(*s)]
        return first, [s for s in specs if not self.mine(*s)]


def local_ranks() -> tuple[int, int] | None:
    """(this process's rank on its host, the host's rank count), as torchrun sets them
    (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); None where they are not set."""
    try:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def host_share(job_ranks: int, device) -> HostShare | None:
    """This rank's ``HostShare`` when the default process group is the job's ``job_ranks`` ranks
    (every rank builds at start-up at once), else None (each rank builds all it records).
    Every rank of such a job gets one, a rank alone on its host (or without torchrun's local
    ranks) one of a single rank: the barrier needs them all. ``device``: where the group's
    backend takes tensors."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != job_ranks:
        return None
    ranks = local_ranks()
    if ranks is None or not 0 <= ranks[0] < ranks[1]:
        ranks = (0, 1)
    where = torch.device(device) if dist.get_backend() == "nccl" else torch.device("cpu")

    def barrier() -> None:
        flag = torch.ones(1, device=where)
        dist.all_reduce(flag)
        flag.item()  # the host waits until every rank has arrived

    return HostShare(ranks[0], ranks[1], barrier)
