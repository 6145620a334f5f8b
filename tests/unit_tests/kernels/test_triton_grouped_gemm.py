"""The routed experts' GEMMs in Triton over expert-sorted rows (``triton_grouped_gemm``), in
Triton's interpreter on CPU: rows planned at the kernel's row tile, gathered, through both GEMMs
(SwiGLU and relu^2 experts), summed back per token, against the torch reference loop on fresh
random inputs; experts with no token, experts over several row tiles, ids of no expert, K and the
widths crossing several tiles with a partial last one. The GPU file compares it with the grouped
GEMM at the 30B-A3B layer's shape and replays it in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from megatron_async.kernels import triton_grouped_gemm
from megatron_async.kernels.moe_grouped_mm import combine_slots_torch, plan_rows_torch
from megatron_async.kernels.moe_torch import fused_experts_torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's tiles; CUDA: the gpu file")

CASES = [  # M, K, I, H, E, k, gated, dropped, experts_used
    (40, 48, 40, 24, 4, 2, True, 0.0, None),  # 16-row tiles: experts over several; I, H cut tiles short
    (60, 32, 16, 40, 8, 3, False, 0.2, 5),  # relu^2; 3 experts get no token; ids of no expert
]


@pytest.mark.parametrize("M, K, I, H, E, k, gated, dropped, experts_used", CASES)
def test_experts_match_the_reference(M, K, I, H, E, k, gated, dropped, experts_used):
    g = torch.Generator().manual_seed(M * 3 + E)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I if gated else I, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts_used or E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    if dropped:
        ids = torch.where(torch.rand(ids.shape, generator=g) < dropped, E + 1, ids)
    w = torch.rand(M, k, generator=g)
    assert triton_grouped_gemm.takes(x, w13, w2)
    tile = triton_grouped_gemm.row_tile(x.device)
    row_of_pair, token_of_row, ends = plan_rows_torch(ids, E, tile)
    rows = torch.diff(ends, prepend=ends.new_zeros(1))
    assert bool((rows % tile == 0).all()) and int(rows.max()) > tile  # an expert over several row tiles
    y = triton_grouped_gemm.experts(x.index_select(0, token_of_row), w13, w2, ends, gated)
    out = combine_slots_torch(y, row_of_pair, ids, w, E, x.dtype)
    ref = fused_experts_torch(x, w13, w2, ids, w, gated)
    assert float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < 3e-2
