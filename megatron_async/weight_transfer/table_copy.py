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

ITEM_ELEMENTS = 1 << 16
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


def table_geometry(dst: torch.Tensor, src: torch.Tensor) -> tuple[list[int], list[int], list[int]] | None:
    """``geometry`` of a pair that qualifies for the table, None for one that does not (the
    caller keeps its own copies): ``TableCopy`` takes it as worked out here, once per pair."""
    if (triton is None or dst.device.type != "cuda" or src.device != dst.device or dst.dtype != src.dtype
            or dst.element_size() not in _BITS):
        return None
    return geometry(dst, src)


def qualifies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return table_geometry(dst, src) is not None


def _aligned(x: int, element_size: int) -> bool:
    return (x * element_size) % 16 == 0


class TableCopy:
    """The pairs (each ``qualifies``) bound to their addresses; ``run()`` copies them all again.
    ``geometries``: each pair's ``geometry`` when the caller worked it out already."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], item_elements: int = ITEM_ELEMENTS,
                 geometries: list[tuple] | None = None):
        self.dsts, self.srcs = dsts, srcs  # (held: the table names their memory)
        self.elements = sum(d.numel() for d in dsts)
        pairs: dict[tuple[int, bool], list[list[int]]] = {}
        if geometries is None:
            geometries = [geometry(dst, src) for dst, src in zip(dsts, srcs)]
        for dst, src, (sizes, dstride, sstride) in zip(dsts, srcs, geometries):
            size = dst.element_size()
            sptr, dptr = src.data_ptr(), dst.data_ptr()
            aligned = (sptr % 16 == 0 and dptr % 16 == 0
                       and all(_aligned(x, size) for x in (sizes[2], dstride[0], dstride[1], sstride[0], sstride[1])))
            pairs.setdefault((size, aligned), []).append(
                [sptr, dptr, sizes[1], sizes[2], sstride[0], sstride[1], dstride[0], dstride[1], sizes[0] * sizes[1], size])
        device = dsts[0].device if dsts else None
        # the items worked out on the host and copied once: on the device they took ~30 small
        # kernels and two syncs per table (each a first load of its kernel at an engine's first update)
        self.tables = [(size, aligned, _items(torch.tensor(rows, dtype=torch.int64), item_elements).to(device))
                       for (size, aligned), rows in sorted(pairs.items())]
        self.launches = len(self.tables)

    def run(self) -> int:
        for size, aligned, table in self.tables:
            _copy_rows[(table.shape[0],)](table, ELEM=getattr(tl, _BITS[size]), ALIGNED=aligned, VEC=16 // size,
                                          BLOCK=BLOCK, FIELDS=_FIELDS)
        return self.elements


def _items(pairs: torch.Tensor, item_elements: int) -> torch.Tensor:
    """The work items of ``pairs`` (rows of [src, dst, n1, n2, ss0, ss1, ds0, ds1, rows, element
    size]), computed for all pairs at once (an 8B model has ~10^5 items): short rows grouped whole
    into items of at most ``item_elements``, a longer row cut into pieces of that many."""
    n2, rows = pairs[:, 3], pairs[:, 8]
    long = n2 > item_elements
    per = torch.where(long, 1, item_elements // n2.clamp(min=1))  # rows per item (short rows)
    pieces = torch.where(long, (n2 + item_elements - 1) // item_elements, 1)  # items per row (long rows)
    counts = torch.where(long, rows * pieces, (rows + per - 1) // per)
    total = int(counts.sum())
    owner = torch.repeat_interleave(torch.arange(len(pairs), device=pairs.device), counts, output_size=total)
    local = torch.arange(total, device=pairs.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts,
                                                                               output_size=total)
    p = pairs[owner]
    is_long, p_per, p_pieces = long[owner], per[owner], pieces[owner]
    col = torch.where(is_long, (local % p_pieces) * item_elements, 0)
    first = torch.where(is_long, local // p_pieces, local * p_per)
    count = torch.where(is_long, 1, torch.minimum(p_per, p[:, 8] - first))
    width = torch.where(is_long, torch.clamp(p[:, 3] - col, max=item_elements), p[:, 3])
    shift = col * p[:, 9]
    return torch.stack([p[:, 0] + shift, p[:, 1] + shift, p[:, 2], width, p[:, 4], p[:, 5], p[:, 6], p[:, 7],
                        first, count], dim=1).contiguous()


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
