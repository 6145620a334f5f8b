"""The transfer group: a process group of its own between a trainer's sending ranks and every
engine rank (ranks [0, rank_offset) send, rank_offset + r is engine rank r). It is built from a
``TCPStore`` directly (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on GPUs) and never
becomes the default group, so it lives beside the engine's TP / EP group and the trainer's own
Megatron-Core groups. Rank 0 hosts the store.

A transfer is framed by two all-gathers of ``int64[2]`` (``frame``): begin ``[status, manifest
digest]`` (every rank checked the manifest before any byte moves; a refusal, or manifests that
differ, stops everyone with nothing copied) and end ``[status, elements copied]`` (each engine
rank reports whether it copied exactly what its plan expects).

Both ends wait for each other only up to the group's timeout: a set-up nobody joins raises
``TransferFailed`` naming the address, the port and the timeout, and leaves no store or group."""
from __future__ import annotations

import os
import random
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

STORE_PREFIX = "megatron_async_weight_transfer"
BACKENDS = ("gloo", "nccl")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on ``host`` listens on now, for a store or group that some process binds
    later (``init_transfer_group``'s ``port``, torchrun's MASTER_PORT). Drawn below the kernel's
    ephemeral range: a port from ``bind(0)`` is one the kernel also hands to outgoing connections,
    which may take it before it is bound."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is taken: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


class TransferFailed(RuntimeError):
    """A transfer that some rank refused or did not complete (the message says which)."""


@dataclass
class TransferGroup:
    pg: object
    rank: int
    world_size: int
    device: torch.device
    """Where collectives' tensors live: CPU for gloo, this process's GPU for NCCL."""
    store: object = None
    where: str = ""
    """The store's ``host:port`` (for messages)."""
    timeout_s: float = 300.0
    """How long a collective of this group waits for the other ranks."""

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([t], opts).wait()

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.pg.allgather([out], [t]).wait()
        return out

    def frame(self, status: int, value: int) -> list[tuple[int, int]]:
        """Every rank's (status, value). On a GPU it runs on a side stream of its own, so that a
        frame waiting for the other ranks (from another thread) holds no stream the engine uses."""
        if self.device.type != "cuda":
            return self._frame(status, value)
        with torch.cuda.device(self.device), torch.cuda.stream(torch.cuda.Stream(self.device)):
            return self._frame(status, value)

    def _frame(self, status: int, value: int) -> list[tuple[int, int]]:
        mine = torch.tensor([status, value], dtype=torch.int64, device=self.device)
        return [tuple(int(x) for x in t.tolist()) for t in self.all_gather(mine)]

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None) or getattr(self.pg, "_shutdown", None)
        if shutdown is not None and self.device.type == "cuda":
            shutdown()
        self.pg = self.store = None


def check_group_args(master_address, master_port, rank_offset, world_size, backend) -> None:
    """ValueError naming the first bad argument of ``init_weight_transfer``."""
    if not isinstance(master_address, str) or not master_address:
        raise ValueError(f"master_address must be a host name or address, got {master_address!r}")
    for name, value, low in (("master_port", master_port, 1), ("rank_offset", rank_offset, 0),
                             ("world_size", world_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if master_port > 65535:
        raise ValueError(f"master_port must be <= 65535, got {master_port}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


def init_transfer_group(master_address: str, master_port: int, rank: int, world_size: int,
                        backend: str = "gloo", timeout_s: float = 300.0,
                        device: torch.device | None = None) -> TransferGroup:
    """Join a transfer group as ``rank`` of ``world_size`` (blocks until every rank joined, or
    about ``timeout_s``: the store's connection retries and the group's rendezvous each wait up to
    it). ``device`` (NCCL): this rank's GPU (default: the current one). ``TransferFailed`` when
    the group could not be set up (nothing of it is kept)."""
    check_group_args(master_address, master_port, 0, world_size, backend)
    check_timeout(timeout_s)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    timeout, where, start = timedelta(seconds=timeout_s), f"{master_address}:{master_port}", time.monotonic()
    try:
        store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        if backend == "gloo":
            return TransferGroup(dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), rank, world_size,
                                 torch.device("cpu"), store, where, timeout_s)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (lent machines refuse it)
        device = device or torch.device("cuda", torch.cuda.current_device())
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        return TransferGroup(pg, rank, world_size, device, store, where, timeout_s)
    except Exception as e:  # noqa: BLE001 -- torch's store and group errors: one message saying where and how long
        reason = (str(e).strip().splitlines() or [""])[0]  # (torch appends its C++ stack)
        raise TransferFailed(f"the weight transfer group at {where} was not set up (rank {rank} of {world_size}, "
                             f"{backend}, timeout {timeout_s:g} s, gave up after {time.monotonic() - start:.1f} s): "
                             f"{type(e).__name__}: {reason}") from None


def check_timeout(timeout_s) -> None:
    """ValueError unless ``timeout_s`` is a positive finite number of seconds."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
