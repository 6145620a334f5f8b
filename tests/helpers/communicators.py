"""Communicators of spawned ranks, joined as an engine's ranks join: through a torch store."""
from __future__ import annotations

from datetime import timedelta

from megatron_async.inference.communication.zmq_communicator import ZMQCommunicator


def store(rank: int, world: int, port: int, timeout_s: float = 30.0):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=timeout_s))


def join(rank: int, world: int, port: int, **kwargs) -> ZMQCommunicator:
    """``ZMQCommunicator`` of ``rank`` through a TCPStore on ``port`` (rank 0 serves it)."""
    s = store(rank, world, port)
    comm = ZMQCommunicator(rank, world, s, **kwargs)
    comm.store = s  # rank 0 serves the store: keep it as long as the communicator
    return comm
