"""The expert-parallel group's all-gather and reduce-scatter through CUDA P2P instead of NCCL.

Every MoE layer under expert parallelism runs one all-gather (tokens + routing) and one
reduce-scatter (the experts' partial outputs) over the EP group; at decode sizes (hundreds of
KB) NCCL's fixed cost per collective dominates them. Like the TP all-reduce
(``p2p_all_reduce.py``, whose setup this reuses), every EP rank owns a buffer of torch symmetric
memory mapped into its peers at load, and each collective is one Triton kernel with a flag
barrier (``kernels/triton_p2p_exchange.py``). Messages above ``max_bytes``, odd sizes, or a group
that cannot map P2P go to NCCL; every rank decides alike (same shapes on every EP rank: the
engines agree on the padded token count). Multicast is never used."""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import torch
import torch.distributed as dist

from megatron_async.parallel.p2p_all_reduce import PeerTables, _rendezvous_buffer, peer_tables
from megatron_async.parallel.p2p_checks import SELF_TEST_TIMEOUT_S, all_agree, group_problem, local_problem, wait_or_raise
from megatron_async.parallel.state import ParallelState

log = logging.getLogger("megatron_async")

EP_P2P_MAX_BYTES = 16 << 20
"""Largest all-gather output / reduce-scatter input taken (decode and small mixed steps);
larger exchanges (long prefill chunks) go to NCCL, which is bandwidth-efficient there."""


def with_p2p_exchange(parallel: ParallelState, enabled: bool, device: torch.device,
                      max_bytes: int = EP_P2P_MAX_BYTES) -> ParallelState:
    """``parallel`` with its EP group's P2P exchange attached (``parallel.ep_exchanger``), or
    unchanged (NCCL / gloo) when EP is off, ``enabled`` is false, or the group cannot use P2P.
    Collective over the EP group on CUDA; call it on every rank before serving."""
    if parallel.ep_size == 1 or not enabled or device.type != "cuda":
        return parallel
    exchanger = P2PExchange.create(parallel.ep_group, device, max_bytes)
    return parallel if exchanger is None else dataclasses.replace(parallel, ep_exchanger=exchanger)


class P2PExchange:
    """The EP group's symmetric buffer; ``accepts`` then ``all_gather`` / ``reduce_scatter``."""

    def __init__(self, buffer: torch.Tensor, peers: PeerTables, max_bytes: int):
        self.buffer, self.peers, self.max_bytes = buffer, peers, max_bytes
        """``max_bytes`` is mutable: 0 sends everything to NCCL (A/B runs in one process)."""
        self.calls: Counter = Counter()
        """Host-side count of calls per collective ("all_gather", "reduce_scatter"); a graph counts at capture."""

    @classmethod
    def create(cls, group, device: torch.device, max_bytes: int) -> P2PExchange | None:
        """Every rank checks itself, the ranks agree, they allocate and exchange the buffers and
        run a self-test; None (NCCL for everything, on every rank) if any step fails anywhere."""
        problem, exchanger = group_problem(group, device, local_problem(device)), None
        if problem is None:
            try:
                buffer, handle = _rendezvous_buffer(group, device, 2 * max_bytes)  # two halves, used alternately
                peers = peer_tables(handle, buffer, device, max_bytes, "P2P EP exchange")
                if peers is None:
                    raise RuntimeError("no peer address tables from torch symmetric memory")
                exchanger = cls(buffer, peers, max_bytes)
                problem = exchanger.self_test()
            except Exception as e:  # noqa: BLE001 - any failure means: use NCCL
                problem = f"rank {dist.get_rank(group)}: {e}"
        if not all_agree(problem is None, group, device):
            log.info("EP exchange over NCCL (no P2P): %s", problem or "set-up failed on another rank")
            return None
        return exchanger

    def self_test(self) -> str | None:
        """Exactly representable values through both collectives, compared bit for bit."""
        rank, world, device = self.peers.rank, self.peers.world_size, self.buffer.device
        x = torch.arange(6 * 40, device=device, dtype=torch.float32).view(6, 40) + 1000 * rank
        gathered = self.all_gather(x)
        summed = self.reduce_scatter(torch.cat([x] * world))
        wait_or_raise(SELF_TEST_TIMEOUT_S, f"P2P EP exchange self-test on rank {rank}")
        want_gather = torch.cat([x - 1000 * rank + 1000 * r for r in range(world)])
        want_sum = (x - 1000 * rank) * world + 1000 * world * (world - 1) // 2
        self.calls.clear()
        if not torch.equal(gathered, want_gather) or not torch.equal(summed, want_sum):
            return f"self-test values wrong on rank {rank}"
        return None

    def accepts(self, x: torch.Tensor, gather: bool) -> bool:
        """Whether ``x`` takes the P2P path (the same answer on every rank for the same shape)."""
        nbytes = x.numel() * x.element_size()  # what the buffer holds: x, for either collective
        return (x.is_cuda and x.is_contiguous() and nbytes % 4 == 0 and 0 < nbytes <= self.max_bytes
                and (gather or x.shape[0] % self.peers.world_size == 0)
                and x.dtype in (torch.float32, torch.bfloat16, torch.float16))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        from megatron_async.kernels import triton_p2p_exchange

        p = self.peers
        self.calls["all_gather"] += 1
        return triton_p2p_exchange.all_gather(x, p.buffers, p.signal_pads, p.state, p.half_bytes, p.rank,
                                              p.max_programs)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        from megatron_async.kernels import triton_p2p_exchange

        p = self.peers
        self.calls["reduce_scatter"] += 1
        return triton_p2p_exchange.reduce_scatter(x, p.buffers, p.signal_pads, p.state, p.half_bytes, p.rank,
                                                  p.max_programs)

    def close(self) -> None:
        """Drop the buffer (before the process group goes); later calls go to NCCL."""
        self.buffer, self.max_bytes = None, 0
