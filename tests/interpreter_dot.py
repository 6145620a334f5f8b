"""Triton's CPU interpreter with a ``tl.dot`` whose rows do not depend on each other.

The interpreter multiplies tiles with ``np.matmul``, i.e. the machine's BLAS, and OpenBLAS's
x86 kernels (AVX2 at least) round an output row differently depending on where it sits in the
tile: permuting a tile's rows changes their bits. A GPU's MMA computes each output element
from its own row and column only, which is what the batch-invariant kernels and their tests
rely on. ``np.einsum`` (no BLAS) sums each element's products in K order, whatever its
neighbours: the tests and `python -m benchmarks engine-times batch-invariance --smoke` use it through
this patch.

Imports nothing of megatron_async: it runs before TRITON_INTERPRET is set for the kernel
modules, which choose interpreted or compiled when they are imported."""
from __future__ import annotations

import numpy as np


def make_interpreter_dot_row_independent() -> None:
    """Replace the interpreter's float ``tl.dot`` by an einsum (idempotent; no-op without triton)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "row_independent", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype.kind != "f" or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out_dtype = d.data.dtype
        prod = np.einsum("...mk,...kn->...mn", a.data.astype(out_dtype), b.data.astype(out_dtype))
        return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot.row_independent = True
    builder.create_dot = create_dot
