"""A repeated copy from sources that stay where they are (storages mapped over IPC) as few
multi-tensor launches as its pairs allow.

``torch._foreach_copy_`` runs its multi-tensor kernel (up to ~100 pairs a launch) only when every
destination shares one device and dtype, every source one device and dtype, each is dense, and
each pair's sizes and strides agree; one pair that does not sends the whole list to a copy per
pair (a launch and its host dispatch each: hundreds for a model whose trainer holds every
parameter in a storage of its own, with a dtype of its own for a few). ``GroupedCopy`` sorts a
bound copy's pairs once into lists that each meet those conditions (the rest in lists of their
own, copied pair by pair as before), so a repeated update launches a few kernels per dtype pair.
The bytes copied and their rounding are ``copy_``'s either way.

On a GPU with Triton, ``kernel="table"`` sends the same-dtype pairs to one launch per element size
instead (``table_copy.TableCopy``: strided pairs included), and only the rest (dtype conversions)
to the multi-tensor lists. Not the default: in one run of ``python -m benchmarks refit-ipc`` on an
H200 a later update took 8.8 / 12.5 ms with it against 5.5 / 8.0 with the lists (flat / separate
0.6B layouts, a host busy with other jobs)."""
from __future__ import annotations

import torch

from megatron_async.models.slab_loading import BoundCopy
from megatron_async.weight_transfer.table_copy import TableCopy, table_geometry

KERNELS = ("auto", "table", "foreach")
"""How a bound copy launches: "table" (one Triton launch per element size for the pairs that
qualify), "foreach" (``torch._foreach_copy_`` lists), "auto" (an engine's choice: the table once
its kernel is compiled, which an engine does off its start-up path (``TableCompile``), the lists
until then; here, the lists)."""

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
    """``bound.run()`` with its plain pairs copied in one table launch per element size
    (``kernel``: see ``KERNELS``) and ``group_pairs`` lists."""

    def __init__(self, bound: BoundCopy, kernel: str = "auto"):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.bound = bound
        table: Lists = ([], [])
        shapes: list[tuple] = []
        rest: list[Lists] = []
        for dsts, srcs in (bound.dense, bound.strided):
            left: Lists = ([], [])
            for dst, src in zip(dsts, srcs):
                geo = table_geometry(dst, src) if kernel == "table" else None
                side = left if geo is None else table
                side[0].append(dst)
                side[1].append(src)
                if geo is not None:
                    shapes.append(geo)
            rest += group_pairs(*left)
        self.table = TableCopy(*table, geometries=shapes) if table[0] else None
        self.groups = rest
        self.launches = (self.table.launches if self.table else 0) + len(rest)
        """Kernel lists launched per run (a list that does not qualify for the multi-tensor
        kernel is a launch per pair)."""

    def run(self) -> int:
        """Copies everything again; returns the elements copied (``BoundCopy.run``'s count)."""
        with torch.no_grad():
            if self.table is not None:
                self.table.run()
            for dsts, srcs in self.groups:
                torch._foreach_copy_(dsts, srcs)
        bound = self.bound
        return bound.elements + bound.program.run(bound.with_sinks)
