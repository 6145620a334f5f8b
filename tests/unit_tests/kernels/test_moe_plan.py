"""The row plan's two Triton kernels (``triton_moe_plan.plan_rows``; interpreted on CPU, compiled
on CUDA) against its torch reference ``moe_grouped_mm.plan_rows_torch``, bit for bit: the
Qwen3-30B-A3B prefill shape (65,536 pairs, 128 experts; a quarter of the pairs interpreted) with
ids of no expert mixed in, tiny batches, pair counts that are not a multiple of the segment,
expert counts that are not a power of two, experts with no pair, several segments per expert
(counts carried between programs), segments cut in 1 to 8 slices; and the same kernels in the
fused MoE's layout (``align_pairs``) against its torch alignment on the layer's router (GPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import moe_grouped_mm, triton_moe_plan  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """The kernels' outputs start as -7, not whatever memory held: a row left unwritten shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: empty(*shape, **kw).fill_(-7))


def _ids(M, k, E, seed, skewed=False, empty=None):
    """Random routing with ids of no expert (negative, E and beyond) and expert ``empty`` (default
    E // 2) left without pairs; ``skewed``: most pairs on a few experts (some groups span many
    segments, others get none)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2, E + 3, (M, k), generator=g)
    if skewed:
        ids = torch.where(torch.rand(M, k, generator=g) < 0.7, ids % 3, ids)
    ids[ids == (E // 2 if empty is None else empty)] = 0
    return ids.to(torch.int32)


def _check(ids, E, seg=None, warps=None):
    ref = moe_grouped_mm.plan_rows_torch(ids, E)
    kw = {} if warps is None else {"num_warps": warps}  # None: the default
    out = triton_moe_plan.plan_rows(ids.to(DEVICE), E, moe_grouped_mm.ROW_ALIGN, seg, **kw)
    for name, a, b in zip(("row_of_pair", "token_of_row", "offs"), ref, out):
        assert b.dtype == torch.int32 and torch.equal(a.long(), b.cpu().long()), name


@pytest.mark.parametrize("M, k, E, empty", [(0, 2, 4, None), (1, 8, 128, None), (23, 3, 6, 5), (40, 2, 5, 0),
                                             (9, 1, 127, 126), (17, 4, 3, None)])
@pytest.mark.parametrize("seg, warps", [(None, None), (None, 8), (16, 4), (32, 1)])  # one segment, several; slices of 4 to 32 ids
def test_small_plans_match_the_reference(M, k, E, empty, seg, warps):
    _check(_ids(M, k, E, seed=M + 31 * E, empty=empty), E, seg, warps)


PREFILL_M = 8192 if DEVICE == "cuda" else 2048
"""30B-A3B's 8,192-token prefill compiled; interpreted, a quarter of it: its 16,384 pairs still take the
largest segment (512, as 65,536 do), in 32 programs, and the skewed experts still span several segments each
(the interpreter's time is linear in the pairs; the GPU tests run the full shape)."""


@pytest.mark.parametrize("M, E, seg, warps, skewed", [(PREFILL_M, 128, None, None, True), (PREFILL_M, 128, 1024, 8, True),
                                                    (1000, 128, None, 4, True), (700, 128, 256, 2, False),
                                                    (300, 384, None, 8, False)])
def test_prefill_plans_match_the_reference(M, E, seg, warps, skewed):
    """30B-A3B shapes: PREFILL_M x 8 pairs (programs of 512 in 4 slices; of 1,024 in 8), 8,000 (not a multiple of
    the segment); 384 experts (512 bins)."""
    assert triton_moe_plan.segment_size(PREFILL_M * 8) == triton_moe_plan.MAX_SEG
    ids = _ids(M, 8, E, seed=M, skewed=skewed)
    assert (ids < 0).any() and (ids >= E).any()
    _check(ids, E, seg, warps)


def test_segment_size_aims_for_enough_programs_within_bounds():
    assert triton_moe_plan.segment_size(65536) == 512 and triton_moe_plan.segment_size(16384) == 512
    assert triton_moe_plan.segment_size(4096) == triton_moe_plan.segment_size(0) == triton_moe_plan.MIN_SEG
    assert triton_moe_plan.segment_size(1 << 20) == triton_moe_plan.MAX_SEG


def test_bad_segment_is_a_clear_error():
    with pytest.raises(ValueError, match="powers of two"):
        triton_moe_plan.plan_rows(torch.zeros(4, 2, dtype=torch.int32, device=DEVICE), 4, 8, seg=48)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plan_replays_in_a_cuda_graph_on_new_routing():
    """Captured once at the 30B prefill shape, replayed on new ids (some of no expert): the
    reference's bits (grids and bounds from shapes, nothing read on the host)."""
    ids = _ids(8192, 8, 128, seed=1).cuda()
    triton_moe_plan.plan_rows(ids, 128, moe_grouped_mm.ROW_ALIGN)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe_plan.plan_rows(ids, 128, moe_grouped_mm.ROW_ALIGN)
    ids.copy_(_ids(8192, 8, 128, seed=2, skewed=True).cuda())
    graph.replay()
    for a, b in zip(moe_grouped_mm.plan_rows_torch(ids, 128), out):
        assert torch.equal(a.long(), b.long())


def _layer_routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Qwen3-30B-A3B layer's router ids on fresh tokens, and the same with a tenth of them moved
    to other ranks' experts (CUDA)."""
    from tests.helpers.moe_layers import QWEN3_30B_HIDDEN, qwen3_30b_moe_layer

    layer = qwen3_30b_moe_layer()
    g = torch.Generator(device="cuda").manual_seed(tokens)
    with torch.no_grad():
        x = torch.randn(tokens, QWEN3_30B_HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        ids = layer.gate.route(x)[0]
    return ids, torch.where(torch.rand(ids.shape, device="cuda", generator=g) < 0.1, ids + 128, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [512, 2048, 8192])
@pytest.mark.parametrize("seg", [None, 128, 256, 512, 1024, 2048])
def test_plans_of_the_layers_routing_at_every_segment_size(tokens, seg):
    """The Qwen3-30B-A3B layer's router on fresh tokens (4,096 / 16,384 / 65,536 pairs), alone
    and with a tenth of its ids moved to other ranks' experts, at every segment size and 4 or 8
    warps: the reference's bits."""
    ids, dropped = _layer_routing(tokens)
    for warps in (4, 8):
        for routing in (ids, dropped):
            _check(routing.cpu(), 128, seg, warps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens, block_m", [(128, 16), (1024, 32), (3072, 64)])
def test_fused_moe_alignment_of_the_layers_routing(tokens, block_m):
    """``align_pairs`` (the fused MoE's layout from the plan's kernels) on the Qwen3-30B-A3B router's
    ids, alone and with a tenth moved to other ranks' experts, captured in a graph and replayed on
    new ids: the torch alignment's blocks, and its pairs in every live block."""
    from megatron_async.kernels import triton_fused_moe

    ids, dropped = _layer_routing(tokens)
    live_ids = ids.clone()
    triton_moe_plan.align_pairs(live_ids, 128, block_m)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe_plan.align_pairs(live_ids, 128, block_m)
    for routing in (ids, dropped):
        live_ids.copy_(routing)
        graph.replay()
        ref_pairs, ref_blocks = triton_fused_moe.align_by_expert(routing, 128, block_m)
        assert torch.equal(out[1], ref_blocks)
        live = (ref_blocks < 128).repeat_interleave(block_m)
        assert torch.equal(out[0][live], ref_pairs[live])
