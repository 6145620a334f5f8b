"""What Triton specializes on after the EP exchange, recorded: for every MoE layer a forward
runs, the exchange's results, the routed experts' inputs, and what the caller passes out, each
as (shape, strides, dtype, 16-byte alignment, contiguous). The dry pass's stand-ins
(parallel/dry_exchange.py) must give the same record as the real exchange. ``no_collectives``:
every torch.distributed collective the exchange can issue raises for the block."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_async.models.layers import moe
from megatron_async.parallel import communication


def signature(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), str(t.dtype), t.data_ptr() % 16, t.is_contiguous()


@contextlib.contextmanager
def recording():
    """Yields the list the block's MoE exchanges append their records to."""
    seen = []
    gather, scatter, compute = moe.ep_all_gather, moe.ep_reduce_scatter, moe.RoutedExperts._compute

    def record(fn):
        def wrapped(*args, **kw):
            out = fn(*args, **kw)
            seen.append((fn.__name__, signature(out)))
            return out
        return wrapped

    def compute_rec(self, x, ids, weights, *rest, **kw):
        seen.append(("experts", signature(x), signature(ids), signature(weights)))
        return compute(self, x, ids, weights, *rest, **kw)

    moe.ep_all_gather, moe.ep_reduce_scatter, moe.RoutedExperts._compute = record(gather), record(scatter), compute_rec
    try:
        yield seen
    finally:
        moe.ep_all_gather, moe.ep_reduce_scatter, moe.RoutedExperts._compute = gather, scatter, compute


def _raise(*args, **kwargs):
    raise AssertionError("the dry pass issued a collective")


@contextlib.contextmanager
def no_collectives():
    names = ("all_gather", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
    saved = {name: getattr(dist, name) for name in names}
    saved_single = communication._all_gather_into_tensor
    try:
        for name in names:
            setattr(dist, name, _raise)
        communication._all_gather_into_tensor = _raise
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        communication._all_gather_into_tensor = saved_single
