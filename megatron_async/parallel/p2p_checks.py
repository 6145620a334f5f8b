"""Whether the ranks of a group can take part in a P2P collective (CUDA symmetric memory), decided
alike on every rank, and the wait that turns P2P mappings that do not work into an error, not a
hang: shared by the TP all-reduce (``p2p_all_reduce.py``) and the EP exchange (``p2p_exchange.py``)."""
from __future__ import annotations

import logging
import socket
import time

import torch
import torch.distributed as dist

from megatron_async.parallel.plain_gather import all_gather_plain

log = logging.getLogger("megatron_async")

SELF_TEST_TIMEOUT_S = 30.0
"""How long the load-time self-test may take before the P2P path is declared broken."""


def local_problem(device: torch.device) -> str | None:
    """Why this rank cannot take part (None: it can)."""
    if device.type != "cuda":
        return f"needs CUDA devices (device is {device})"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch has no symmetric memory ({e})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return "torch lacks torch.ops.symm_mem.one_shot_all_reduce_copy_out"
    return None


def wait_or_raise(timeout_s: float, what: str) -> None:
    """Wait for the current stream's work, raising RuntimeError after ``timeout_s``: P2P mappings
    that do not work make the kernels spin forever (an error, not a hang)."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            msg = (f"{what} did not finish in {timeout_s:.0f} s: the GPUs' P2P mappings do not work here; "
                   "use InferenceConfig.tp_all_reduce='nccl'")
            log.error(msg)
            raise RuntimeError(msg)
        time.sleep(0.001)


def all_agree(ok: bool, group, device: torch.device) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def group_problem(group, device: torch.device, local_problem: str | None) -> str | None:
    """Collective over ``group``: the first reason any rank cannot take part in a P2P
    collective (each rank's ``local_problem``, hosts, peer access), the same on every rank."""
    return _group_problem(all_gather_plain((socket.gethostname(), device.index, local_problem), group, device), device)


def _group_problem(infos: list, device: torch.device) -> str | None:
    """The first reason any rank cannot take part, judged alike on every rank from the gathered
    (host, device index, problem) triples, plus this rank's peer access to the others' GPUs."""
    for rank, (_, _, problem) in enumerate(infos):
        if problem is not None:
            return f"rank {rank}: {problem}"
    if len({host for host, _, _ in infos}) > 1:
        return "the TP group spans several hosts (P2P needs one NVLink domain)"
    indices = [index for _, index, _ in infos]
    if len(set(indices)) == len(indices) and max(indices) < torch.cuda.device_count():  # all GPUs visible here
        blocked = [i for i in indices if i != device.index and not torch.cuda.can_device_access_peer(device.index, i)]
        if blocked:
            return f"GPU {device.index} cannot access the memory of GPUs {blocked}"
    return None
