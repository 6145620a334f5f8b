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

import contextlib
import functools
import importlib.util
import logging
import threading

import numpy as np
import torch

log = logging.getLogger("megatron_async")

ITEM_ELEMENTS = 1 << 16
"""Elements one program copies at most (whole rows, or a piece of one long row); a multiple of
16 bytes' worth of elements of any size, so pieces of an aligned row stay aligned."""
BLOCK = 1024
"""Elements of a row copied per step of a program."""
_FIELDS = 10
_BITS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


@functools.cache
def kernel_available() -> bool:
    """Whether Triton is installed (the kernel, ``table_copy_kernel.py``, imports it on first use:
    a CPU engine never pays for the import)."""
    return importlib.util.find_spec("triton") is not None


def geometry(dst: torch.Tensor, src: torch.Tensor) -> tuple[list[int], list[int], list[int]] | None:
    """(sizes, destination strides, source strides) of at most 3 dims, the innermost contiguous on
    both sides (dims of size 1 dropped, neighbours merged where both sides allow); None if the
    pair has no such form."""
    shape = dst.shape
    return merged_geometry(shape, dst.stride(), src.stride()) if shape == src.shape else None


def merged_geometry(shape, dstride, sstride) -> tuple[list[int], list[int], list[int]] | None:
    """``geometry`` of one shape read with the two sides' strides (plain ints)."""
    merged, last = [], None
    for n, d, s in zip(shape, dstride, sstride):
        if n == 1:
            continue
        if n == 0:
            return None
        if last is not None and last[1] == d * n and last[2] == s * n:
            last[0], last[1], last[2] = last[0] * n, d, s
        else:
            last = [n, d, s]
            merged.append(last)
    if not merged:
        return [1, 1, 1], [0, 0, 1], [0, 0, 1]
    if last[1] != 1 or last[2] != 1 or len(merged) > 3:
        return None
    merged = [[1, 0, 0]] * (3 - len(merged)) + merged
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged]


def table_geometry(dst: torch.Tensor, src: torch.Tensor) -> tuple[list[int], list[int], list[int]] | None:
    """``geometry`` of a pair that qualifies for the table, None for one that does not (the
    caller keeps its own copies): ``TableCopy`` takes it as worked out here, once per pair."""
    dtype = dst.dtype
    if (not dst.is_cuda or not kernel_available() or src.dtype != dtype or src.get_device() != dst.get_device()
            or dtype.itemsize not in _BITS):
        return None
    return geometry(dst, src)


def qualifies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return table_geometry(dst, src) is not None


class TableCopy:
    """The pairs (each ``qualifies``) bound to their addresses; ``run()`` copies them all again.
    ``geometries``: each pair's ``geometry`` when the caller worked it out already."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], item_elements: int = ITEM_ELEMENTS,
                 geometries: list[tuple] | None = None):
        self.dsts, self.srcs = dsts, srcs  # (held: the table names their memory)
        if geometries is None:
            geometries = [geometry(dst, src) for dst, src in zip(dsts, srcs)]
        pairs = np.array([[src.data_ptr(), dst.data_ptr(), sizes[1], sizes[2], sstride[0], sstride[1], dstride[0],
                           dstride[1], sizes[0] * sizes[1], dst.dtype.itemsize]
                          for dst, src, (sizes, dstride, sstride) in zip(dsts, srcs, geometries)],
                         dtype=np.int64).reshape(-1, _FIELDS)
        self.elements = int((pairs[:, 8] * pairs[:, 3]).sum())
        # 16-byte addresses, row lengths and row strides on both sides: vector loads and stores
        aligned = ((pairs[:, :2] % 16 == 0).all(1) & ((pairs[:, 3:8] * pairs[:, 9:]) % 16 == 0).all(1))
        device = dsts[0].device if dsts else None
        # the items worked out on the host and copied once: on the device they took ~30 small
        # kernels and two syncs per table (each a first load of its kernel at an engine's first update)
        self.tables = []
        for size in sorted(set(pairs[:, 9].tolist())):
            for align in (False, True):
                rows = pairs[(pairs[:, 9] == size) & (aligned == align)]
                if len(rows):
                    self.tables.append((size, align, torch.from_numpy(_items(rows, item_elements)).to(device)))
        self.launches = len(self.tables)

    def run(self) -> int:
        from megatron_async.weight_transfer.table_copy_kernel import launch

        for size, aligned, table in self.tables:
            launch(table, _BITS[size], aligned, 16 // size, BLOCK, _FIELDS)
        return self.elements


def _items(pairs: np.ndarray, item_elements: int) -> np.ndarray:
    """The work items of ``pairs`` (rows of [src, dst, n1, n2, ss0, ss1, ds0, ds1, rows, element
    size]), computed for all pairs at once (an 8B model has ~10^5 items; numpy: a few microseconds
    an operation where a torch one on the host takes tens): short rows grouped whole into items of
    at most ``item_elements``, a longer row cut into pieces of that many."""
    n2, rows = pairs[:, 3], pairs[:, 8]
    long = n2 > item_elements
    per = np.where(long, 1, item_elements // np.maximum(n2, 1))  # rows per item (short rows)
    pieces = np.where(long, -(-n2 // item_elements), 1)  # items per row (long rows)
    counts = np.where(long, rows * pieces, -(-rows // per))
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(pairs)), counts)
    local = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.repeat(pairs, counts, axis=0)  # each item its pair's row, then its own fields
    is_long, p_per, p_pieces, p_n2, p_rows = long[owner], per[owner], pieces[owner], n2[owner], rows[owner]
    col = np.where(is_long, (local % p_pieces) * item_elements, 0)
    first = np.where(is_long, local // p_pieces, local * p_per)
    shift = col * out[:, 9]
    out[:, 0] += shift
    out[:, 1] += shift
    out[:, 3] = np.where(is_long, np.minimum(p_n2 - col, item_elements), p_n2)
    out[:, 9] = np.where(is_long, 1, np.minimum(p_per, p_rows - first))
    out[:, 8] = first
    return out


class TableCompile:
    """``table_copy_kernel.compile_forms`` on a daemon thread, started when an engine is built: its start-up does not
    wait for the compiler, and its first IPC update finds the kernel compiled. ``ready()``: compiled
    (False while the thread runs, and for good if it failed: the multi-tensor copies serve)."""

    def __init__(self, device: torch.device, dtypes, quiet=contextlib.nullcontext):
        """``quiet``: a context the compile runs in (an engine's: its builds are not counted as
        kernels its warm-up missed, ``triton_builds.uncounted``)."""
        self._done = threading.Event()
        self._ok = False
        threading.Thread(target=self._run, args=(device, tuple(dtypes), quiet), name="ipc-table-compile",
                         daemon=True).start()

    def _run(self, device: torch.device, dtypes: tuple, quiet) -> None:
        try:
            from megatron_async.weight_transfer.table_copy_kernel import compile_forms

            sizes = sorted({torch.empty(0, dtype=d).element_size() for d in dtypes} & set(_BITS))
            with quiet():
                compile_forms(device, [(_BITS[n], 16 // n) for n in sizes], BLOCK, _FIELDS)
            self._ok = True
        except Exception as e:  # noqa: BLE001 -- the foreach copies serve instead
            log.warning("the IPC table copy kernel did not compile (%s): IPC updates use foreach copies", e)
        finally:
            self._done.set()

    def ready(self) -> bool:
        return self._done.is_set() and self._ok

    def wait(self, timeout_s: float | None = None) -> bool:
        """``ready()`` once the thread ended (or ``timeout_s`` passed)."""
        self._done.wait(timeout_s)
        return self.ready()


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """Compile the kernel's aligned and unaligned forms for ``dtype`` now (an engine's first update
    would otherwise wait for the compiler)."""
    src = torch.zeros(64, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    TableCopy([dst[:16], dst[17:20]], [src[:16], src[17:20]]).run()
