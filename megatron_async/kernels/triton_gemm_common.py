"""Pieces shared by the Triton GEMM kernels (the batch-invariant matmul, its TMA kernel, the fused
MLP kernel and the FP8 GEMM): the order in which a program walks its output tiles."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of the ``tile``-th output tile in grouped order: GROUP_M row
    tiles in a row walk each column of weight tiles together, so a weight tile is reused from
    L2. The order only schedules tiles; each tile's arithmetic is the same wherever it runs."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows
