"""``python -m benchmarks kernel-occupancy`` reads compiled kernels out of Triton's caches: the walk
over the kernel modules (wrappers unwrapped, each kernel once, other packages skipped) and the rows
it makes of each binary, on stand-ins for Triton's objects (a CPU has no compiled kernels)."""
from __future__ import annotations

import sys
import types
from collections import namedtuple

from benchmarks import kernel_occupancy

Metadata = namedtuple("Metadata", "num_warps num_stages shared maxnreg")


class Binary:
    def __init__(self, regs: int, spills: int, md: Metadata):
        self.metadata, self.loaded = md, False
        self._regs, self._spills = regs, spills

    def _init_handles(self):
        self.loaded = True
        self.n_regs, self.n_spills = self._regs, self._spills


class Jit:
    def __init__(self, binaries: list[Binary]):
        self.device_caches = {0: ({i: b for i, b in enumerate(binaries)}, {}, None, None, None)}


class Wrapper:  # an autotuner / heuristics object around the kernel
    def __init__(self, fn):
        self.fn = fn


def test_walk_reads_every_kernel_once_through_wrappers(monkeypatch):
    capped = Binary(128, 0, Metadata(8, 2, 90_144, 128))
    uncapped = Binary(185, 0, Metadata(8, 3, 131_128, None))
    kernel = Jit([capped, uncapped])
    mod = types.ModuleType("megatron_async.kernels._stand_in")
    mod._gate_up_kernel, mod.tuned = kernel, Wrapper(Wrapper(kernel))
    mod.plain_function = len
    other = types.ModuleType("elsewhere")
    other.k = Jit([Binary(32, 0, Metadata(4, 3, 0, None))])
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(sys.modules, other.__name__, other)

    names = [name for name, fn in kernel_occupancy.jit_functions() if fn is kernel]
    assert names == ["_stand_in._gate_up_kernel"]
    assert all(fn is not other.k for _, fn in kernel_occupancy.jit_functions())
    rows = {r for r in kernel_occupancy.compiled_kernels() if r[0] == "_stand_in._gate_up_kernel"}
    assert rows == {("_stand_in._gate_up_kernel", 8, 2, 128, 0, 90_144, 128),
                    ("_stand_in._gate_up_kernel", 8, 3, 185, 0, 131_128, 0)}
    assert capped.loaded and uncapped.loaded
