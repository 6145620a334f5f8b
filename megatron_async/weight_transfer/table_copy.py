"""Many same-dtype copies on one GPU as one kernel launch per element size: a repeated IPC update
copies a few hundred (destination, source) pairs whose addresses never change, and a launch per
pair (strided pairs fall out of ``torch._foreach_copy_``'s multi-tensor kernel) costs more host
time than the copy takes on the device.

At bind, each pair's dims are merged where both sides allow it, down to at most three with the
innermost contiguous on both sides (every pair a weight update makes: whole tensors, and query
groups' rows read out of a QKV shard); its rows (the outer two dims) are cut into work items of
about ``ITEM_ELEMENTS`` elements, and every item is one row of an int64 table on the device
(source and destination addresses, row geometry, first row, row count; a row longer than an item,
a whole contiguous tensor for one, is cut into pieces of its own). The kernel runs one
program per item and copies bits (no conversion), so the result equals ``copy_``'s exactly. A
pair that does not qualify (dtypes differ, inner dim strided, CPU) is left to the caller."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the caller keeps its multi-tensor copies
    triton = None

ITEM_ELEMENTS = 1 << 15
"""Elements one program copies at most (whole rows, or a piece of one long row); a multiple of
16 bytes' worth of elements of any size, so pieces of an aligned row stay aligned."""
BLOCK = 1024
"""Elements of a row copied per step of a program."""
_FIELDS = 10
_BITS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def geometry(dst: torch.Tensor, src: torch.Tensor) -> tuple[list[int], list[int], list[int]] | None:
    """(sizes, destination strides, source strides) of at most 3 dims, the innermost contiguous on
    both sides (dims of size 1 dropped, neighbours merged where both sides allow); None if the
    pair has no such form."""
    if dst.shape != src.shape or dst.numel() == 0:
        return None
    dims = [(n, d, s) for n, d, s in zip(dst.shape, dst.stride(), src.stride()) if n != 1]
    if not dims:
        return [1, 1, 1], [0, 0, 1], [0, 0, 1]
    merged = [list(dims[0])]
    for n, d, s in dims[1:]:
        outer = merged[-1]
        if outer[1] == d * n and outer[2] == s * n:
            outer[0], outer[1], outer[2] = outer[0] * n, d, s
        else:
            merged.append([n, d, s])
    if merged[-1][1] != 1 or merged[-1][2] != 1 or len(merged) > 3:
        return None
    merged = [[1, 0, 0]] * (3 - len(merged)) + merged
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged]


def qualifies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (triton is not None and dst.device.type == "cuda" and src.device == dst.device
            and dst.dtype == src.dtype and dst.element_size() in _BITS and geometry(dst, src) is not None)


def _aligned(x: int, element_size: int) -> bool:
    return (x * element_size) % 16 == 0


class TableCopy:
    """The pairs (each ``qualifies``) bound to their addresses; ``run()`` copies them all again."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], item_elements: int = ITEM_ELEMENTS):
        self.dsts, self.srcs = dsts, srcs  # (held: the table names their memory)
        self.elements = sum(d.numel() for d in dsts)
        rows: dict[tuple[int, bool], list[list[int]]] = {}
        for dst, src in zip(dsts, srcs):
            size = dst.element_size()
            sizes, dstride, sstride = geometry(dst, src)
            sptr, dptr = src.data_ptr(), dst.data_ptr()
            aligned = (sptr % 16 == 0 and dptr % 16 == 0
                       and all(_aligned(x, size) for x in (sizes[2], dstride[0], dstride[1], sstride[0], sstride[1])))
            total, items = sizes[0] * sizes[1], rows.setdefault((size, aligned), [])
            if sizes[2] > item_elements:  # long rows (a whole tensor is one): an item per piece of a row
                for row in range(total):
                    for col in range(0, sizes[2], item_elements):
                        items.append([sptr + col * size, dptr + col * size, sizes[1], min(item_elements, sizes[2] - col),
                                      sstride[0], sstride[1], dstride[0], dstride[1], row, 1])
                continue
            per = item_elements // sizes[2]
            for first in range(0, total, per):
                items.append([sptr, dptr, sizes[1], sizes[2], sstride[0], sstride[1], dstride[0], dstride[1], first,
                              min(per, total - first)])
        device = dsts[0].device if dsts else None
        self.tables = [(size, aligned, torch.tensor(items, dtype=torch.int64, device=device))
                       for (size, aligned), items in sorted(rows.items())]
        self.launches = len(self.tables)

    def run(self) -> int:
        for size, aligned, table in self.tables:
            _copy_rows[(table.shape[0],)](table, ELEM=getattr(tl, _BITS[size]), ALIGNED=aligned, VEC=16 // size,
                                          BLOCK=BLOCK, FIELDS=_FIELDS)
        return self.elements


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """Compile the kernel's aligned and unaligned forms for ``dtype`` now (an engine's first update
    would otherwise wait for the compiler)."""
    src = torch.zeros(64, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    TableCopy([dst[:16], dst[17:20]], [src[:16], src[17:20]]).run()


if triton is not None:
    @triton.jit
    def _copy_rows(table, ELEM: tl.constexpr, ALIGNED: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr,
                   FIELDS: tl.constexpr):
        item = table + tl.program_id(0).to(tl.int64) * FIELDS
        src = tl.load(item).to(tl.pointer_type(ELEM))
        dst = tl.load(item + 1).to(tl.pointer_type(ELEM))
        n1 = tl.load(item + 2)
        n2 = tl.load(item + 3)
        ss0 = tl.load(item + 4)
        ss1 = tl.load(item + 5)
        ds0 = tl.load(item + 6)
        ds1 = tl.load(item + 7)
        first = tl.load(item + 8)
        count = tl.load(item + 9)
        if ALIGNED:  # 16-byte addresses, row starts and row lengths: vector loads and stores
            n2 = tl.multiple_of(n2, VEC)
        for r in range(first, first + count):
            i0 = r // n1
            i1 = r - i0 * n1
            s = src + i0 * ss0 + i1 * ss1
            d = dst + i0 * ds0 + i1 * ds1
            if ALIGNED:
                s = tl.multiple_of(s, 16)
                d = tl.multiple_of(d, 16)
            for c in range(0, n2, BLOCK):
                offs = c + tl.arange(0, BLOCK)
                mask = offs < n2
                tl.store(d + offs, tl.load(s + offs, mask=mask), mask=mask)
