"""Local stand-ins for the expert-parallel token exchange, for a start-up dry pass only.

A dry pass (``kernel_prebuild.py``) captures steps into CUDA graphs that are never replayed, to
learn which Triton specializations they launch. Under expert parallelism every MoE layer
all-gathers its tokens and reduce-scatters the experts' sums over the EP group. Issued there, a
collective would tie every rank's pass to the others' (NCCL even sets connections up
collectively on first use), and the ranks reach their dry captures at different moments. The
stand-in issues none, and hands the layer what the real exchange would on this device: the
all-gather an uninitialised ``[ep_size * n, ...]`` tensor, the reduce-scatter a new ``[n, ...]``
tensor on CUDA (NCCL and P2P both allocate one) or this rank's row block of its input on gloo
(which reduces in place). Kernels after the exchange therefore meet the same shapes, dtypes,
strides and alignment as in the real step, and so the same specializations.

Where the real exchange would take the P2P path (``p2p_exchange.P2PExchange``, a Triton kernel
per collective), the stand-in launches that kernel too, but only inside a capture: such a
launch runs nowhere (the graph is dropped unreplayed), an unbuilt kernel is recorded instead of
launched (``triton_builds.deferring``), and its specialization joins the list. Its call counts
are restored when the block ends. The all-to-all exchange reads sizes on the host (eager only,
never captured): no stand-in for it."""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter

import torch

from megatron_async.config import ExpertExchange
from megatron_async.parallel.state import ParallelState


class LocalExchange:
    """An ``ep_exchanger`` that takes every tensor and communicates nothing (see the module doc)."""

    def __init__(self, parallel: ParallelState):
        self.ep_size, self.ep_rank = parallel.ep_size, parallel.ep_rank
        self.real = parallel.ep_exchanger
        """The P2P exchanger the engine holds (None: NCCL / gloo)."""

    def _p2p(self, x: torch.Tensor, gather: bool) -> bool:
        return (self.real is not None and x.is_cuda and self.real.accepts(x, gather)
                and torch.cuda.is_current_stream_capturing())

    def accepts(self, x: torch.Tensor, gather: bool) -> bool:
        return True

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self._p2p(x, gather=True):
            return self.real.all_gather(x)  # captured, never replayed: only its specialization counts
        return torch.empty((self.ep_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        if self._p2p(x, gather=False):
            return self.real.reduce_scatter(x)
        n = x.shape[0] // self.ep_size
        if x.is_cuda:
            return torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        return x[self.ep_rank * n:(self.ep_rank + 1) * n]  # gloo's result: a row block of the input


def ep_state(model: torch.nn.Module) -> ParallelState | None:
    """The expert-parallel ``ParallelState`` a module of ``model`` holds (None: no EP layer)."""
    for module in model.modules():
        p = module.__dict__.get("parallel")
        if isinstance(p, ParallelState) and p.ep_size > 1:
            return p
    return None


def can_stand_in(model: torch.nn.Module) -> bool:
    """Whether ``local_exchange`` can stand in for every EP exchange of ``model`` (the all-gather
    exchange; not the all-to-all one, which is eager only)."""
    return all(m.__dict__["parallel"].ep_exchange == ExpertExchange.ALL_GATHER for m in model.modules()
               if isinstance(m.__dict__.get("parallel"), ParallelState) and m.__dict__["parallel"].ep_size > 1)


@contextlib.contextmanager
def local_exchange(model: torch.nn.Module):
    """Within the block, every module of ``model`` that holds an expert-parallel ``ParallelState``
    holds a copy whose exchanger is a ``LocalExchange``; the originals are back after it (and the
    P2P exchangers' call counts as they were). Yields how many modules it changed."""
    if not can_stand_in(model):
        raise ValueError("the all-to-all expert exchange reads sizes on the host: no dry pass stands in for it")
    copies: dict[int, ParallelState] = {}
    swapped = []
    for module in model.modules():
        p = module.__dict__.get("parallel")
        if isinstance(p, ParallelState) and p.ep_size > 1:
            if id(p) not in copies:  # one copy per state: equal blocks keep equal settings (dry_blocks.py)
                copies[id(p)] = dataclasses.replace(p, ep_exchanger=LocalExchange(p))
            swapped.append((module, p))
            module.parallel = copies[id(p)]
    counts = {id(p.ep_exchanger): (p.ep_exchanger, Counter(p.ep_exchanger.calls)) for _, p in swapped
              if getattr(p.ep_exchanger, "calls", None) is not None}
    try:
        yield len(swapped)
    finally:
        for module, p in swapped:
            module.parallel = p
        for exchanger, calls in counts.values():
            exchanger.calls.clear()
            exchanger.calls.update(calls)
