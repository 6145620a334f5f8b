"""A repeated copy from sources that stay where they are (storages mapped over IPC) as few
multi-tensor launches as its pairs allow.

``torch._foreach_copy_`` runs its multi-tensor kernel (up to ~100 pairs a launch) only when every
destination shares one device and dtype, every source one device and dtype, each is dense, and
each pair's sizes and strides agree; one pair that does not sends the whole list to a copy per
pair (a launch and its host dispatch each: hundreds for a model whose trainer holds every
parameter in a storage of its own, with a dtype of its own for a few). ``GroupedCopy`` sorts a
bound copy's pairs once into lists that each meet those conditions (the rest in lists of their
own, copied pair by pair as before), so a repeated update launches a few kernels per dtype pair.
The bytes copied and their rounding are ``copy_``'s either way."""
from __future__ import annotations

import torch

from megatron_async.models.slab_loading import BoundCopy

Lists = tuple[list[torch.Tensor], list[torch.Tensor]]


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory, each once, in some order of its dims."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def multi_tensor(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the pair qualifies for the multi-tensor kernel (beside pairs of its devices and dtypes):
    both of one geometry, and dense."""
    return dst.shape == src.shape and dst.stride() == src.stride() and dense(dst)


def group_pairs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> list[Lists]:
    """(destinations, sources) lists, one per (devices, dtypes, whether the pairs qualify), in the
    order each first appears; pairs keep their order within a list."""
    groups: dict[tuple, Lists] = {}
    for dst, src in zip(dsts, srcs):
        key = (dst.device, dst.dtype, src.device, src.dtype, multi_tensor(dst, src))
        d, s = groups.setdefault(key, ([], []))
        d.append(dst)
        s.append(src)
    return list(groups.values())


class GroupedCopy:
    """``bound.run()`` with its plain pairs copied in ``group_pairs`` lists."""

    def __init__(self, bound: BoundCopy):
        self.bound = bound
        self.groups = group_pairs(*bound.dense) + group_pairs(*bound.strided)

    def run(self) -> int:
        """Copies everything again; returns the elements copied (``BoundCopy.run``'s count)."""
        with torch.no_grad():
            for dsts, srcs in self.groups:
                torch._foreach_copy_(dsts, srcs)
        bound = self.bound
        return bound.elements + bound.program.run(bound.with_sinks)
