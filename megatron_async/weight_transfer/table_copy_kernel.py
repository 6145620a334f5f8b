"""The Triton kernel of ``table_copy.TableCopy`` (imported on first use: only CUDA engines load
Triton for it): one program per work item of the table, copying bits."""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger("megatron_async")


def launch(table: torch.Tensor, bits: str, aligned: bool, vec: int, block: int, fields: int) -> None:
    """Copy every item of ``table`` (elements of the int type ``bits``)."""
    _copy_rows[(table.shape[0],)](table, ELEM=getattr(tl, bits), ALIGNED=aligned, VEC=vec, BLOCK=block, FIELDS=fields)


def compile_forms(device: torch.device, forms: list[tuple[str, int]], block: int, fields: int) -> None:
    """Compile the kernel's aligned and unaligned forms for each (element int type, vector width)
    of ``forms`` on ``device`` without launching it: no memory on the device, no stream work (safe
    beside a CUDA graph capture on another thread). A launch later still loads the module
    (milliseconds)."""
    table = torch.zeros(fields, dtype=torch.int64)  # its dtype and alignment are all that specialise
    with torch.cuda.device(device):
        for bits, vec in forms:
            for aligned in (False, True):
                compiled = _copy_rows.warmup(table, ELEM=getattr(tl, bits), ALIGNED=aligned, VEC=vec, BLOCK=block,
                                             FIELDS=fields, grid=(1,))
                _build_launcher(compiled)


def _build_launcher(compiled) -> None:
    """Build the host launcher Triton otherwise builds at a kernel's first launch: a small C module,
    ~0.2 s of a C compiler the first time on a machine (measured: an engine's first IPC update took
    199 ms, 186 of them in its launch), then on disk. Triton's own class, so guarded: without it the
    first launch builds it as before."""
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception as e:  # noqa: BLE001 -- an internal API: the first launch builds it instead
        log.debug("IPC table copy: launcher not built ahead (%s)", e)


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
