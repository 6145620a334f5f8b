"""Grouped-GEMM routed experts on CUDA at the Qwen3-30B-A3B layer shape (hidden 2048, 128
experts, top-8, moe_intermediate 768, bf16) vs the torch reference and the fused Triton MoE (and,
from 256 pairs an expert on Hopper, their GEMMs in ``triton_grouped_gemm`` vs torch's), deterministic, through the layer's own router at prefill token counts (both paths), and under
CUDA-graph capture (no host syncs, fixed shapes) replayed on new inputs. Times: ``python -m
benchmarks kernel-times fused-moe --grouped-mm`` / ``--combine-norm``."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import moe_experts, moe_grouped_mm, triton_fused_moe  # noqa: E402
from megatron_async.kernels.moe_torch import fused_experts_torch  # noqa: E402
from tests.helpers.moe_layers import qwen3_30b_moe_layer  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")]

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768


def _inputs(M, seed=0, gated=True, top_k=TOP_K, dropped=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    n = 2 * INTER if gated else INTER
    w13 = (torch.randn(EXPERTS, n, HIDDEN, device="cuda", generator=g) * HIDDEN ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) * INTER ** -0.5).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(M, EXPERTS, device="cuda", generator=g), -1).topk(top_k, dim=-1)
    ids = ids.to(torch.int32)
    if dropped:  # EP: other ranks' experts and padding rows
        drop = torch.rand(ids.shape, device="cuda", generator=g) < dropped
        ids = torch.where(drop, ids + EXPERTS, ids)
        ids[0, 0] = -1
    return x, w13, w2, ids, weights / weights.sum(-1, keepdim=True)


def _rel_err(out, ref):
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("M, gated, top_k, dropped", [(1, True, 8, 0.0), (300, False, 8, 0.2), (1000, True, 1, 0.0),
                                                      (2048, True, 8, 0.0), (2048, True, 8, 0.3)])
def test_grouped_mm_matches_the_reference_and_the_triton_moe(M, gated, top_k, dropped):
    x, w13, w2, ids, w = _inputs(M, seed=M, gated=gated, top_k=top_k, dropped=dropped)
    out = moe_grouped_mm.fused_experts_grouped_mm(x, w13, w2, ids, w, gated)
    ref = fused_experts_torch(x, w13, w2, ids, w, gated)
    assert _rel_err(out, ref) < 2e-2
    assert _rel_err(out, triton_fused_moe.fused_experts(x, w13, w2, ids, w, gated)) < 3e-2
    assert torch.equal(out, moe_grouped_mm.fused_experts_grouped_mm(x, w13, w2, ids, w, gated))


@pytest.mark.parametrize("tokens", [512, 1024, 2048, 8192])
def test_both_paths_on_the_layers_routing_at_prefill_counts(tokens):
    """The layer's weights (N(0, 0.02)) and routing: the fused Triton MoE and the grouped GEMM each
    within 3e-2 of the largest reference output."""
    layer = qwen3_30b_moe_layer()
    w13, w2 = layer.experts.gate_up_proj.weight, layer.experts.down_proj.weight
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(tokens))
    with torch.no_grad():
        x = x.to(torch.bfloat16)
        ids, w = layer.gate.route(x)
        ref = fused_experts_torch(x, w13, w2, ids, w, True)
        assert _rel_err(triton_fused_moe.fused_experts(x, w13, w2, ids, w, True), ref) < 3e-2
        assert _rel_err(moe_grouped_mm.fused_experts_grouped_mm(x, w13, w2, ids, w, True), ref) < 3e-2


def test_dispatch_takes_prefill_batches_on_hopper():
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the grouped GEMM's device-side offsets need sm90 / sm100")
    x, w13, w2, ids, _ = _inputs(2048)
    assert moe_grouped_mm.use_grouped_mm(x, w13, w2, ids)
    assert not moe_grouped_mm.use_grouped_mm(x[:128], w13, w2, ids[:128])


@pytest.mark.parametrize("M", [2048, 8192])
def test_grouped_mm_replays_in_a_cuda_graph(M):
    """Captured once, replayed on new tokens and routing (some pairs of no expert): the group ends
    (and the Triton GEMMs' tile count, at 8,192 tokens on Hopper) are read on the device."""
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("elsewhere the grouped GEMM reads group sizes on the host")
    x, w13, w2, ids, w = _inputs(M, seed=1)
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert moe_grouped_mm.use_triton_experts(x, w13, w2, ids) == (M == 8192 and hopper)
    moe_experts.fused_experts(x, w13, w2, ids, w, True, triton=True)  # warm up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = moe_experts.fused_experts(x, w13, w2, ids, w, True, triton=True)
    torch.cuda.current_stream().wait_stream(stream)
    fresh = _inputs(M, seed=2, dropped=0.1)  # new tokens and routing (some of no expert), same buffers
    x.copy_(fresh[0]), ids.copy_(fresh[3]), w.copy_(fresh[4])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_grouped_mm.fused_experts_grouped_mm(x, w13, w2, ids, w, True))
    assert _rel_err(out, fused_experts_torch(x, w13, w2, ids, w, True)) < 2e-2


@pytest.mark.parametrize("M, dropped", [(2048, 0.0), (8192, 0.0), (700, 0.3)])
def test_deferred_combine_norm_has_the_bits_of_combine_then_add_rms_norm(M, dropped):
    """The one-kernel slot sum + residual add + RMSNorm (``PendingCombine``) against
    ``combine_slots`` then ``add_rms_norm``, compiled, at the 30B layer width; and replayed in
    a CUDA graph on new rows."""
    from megatron_async.kernels import fused_ops

    x, w13, w2, ids, w = _inputs(M, seed=M + 5, dropped=dropped)
    pending = moe_grouped_mm.fused_experts_grouped_mm(x, w13, w2, ids, w, True, defer_combine=True)
    assert isinstance(pending, moe_grouped_mm.PendingCombine)
    g = torch.Generator(device="cuda").manual_seed(M)
    residual = torch.randn(M, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g)).to(torch.bfloat16)
    for cast_before_weight in (True, False):
        one = pending.add_rms_norm(residual, weight, 1e-6, cast_before_weight)
        two = fused_ops.add_rms_norm(pending.reduce(), residual, weight, 1e-6, cast_before_weight)
        assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out, res_out = pending.add_rms_norm(residual, weight, 1e-6, True)
    torch.cuda.current_stream().wait_stream(stream)
    pending.y.normal_()
    residual.normal_()
    graph.replay()
    torch.cuda.synchronize()
    two = fused_ops.add_rms_norm(pending.reduce(), residual, weight, 1e-6, True)
    assert torch.equal(out, two[0]) and torch.equal(res_out, two[1])


@pytest.mark.parametrize("M, gated, dropped", [(4096, True, 0.0), (8192, True, 0.3), (4096, False, 0.1)])
def test_triton_experts_match_the_grouped_gemm_and_the_reference(M, gated, dropped):
    """At 256+ pairs an expert the grouped path runs its GEMMs in ``triton_grouped_gemm`` on
    Hopper: within 2e-2 of the reference, within 3e-2 of torch's grouped GEMM (the switch off),
    deterministic."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Triton experts run on Hopper")
    x, w13, w2, ids, w = _inputs(M, seed=M + 11, gated=gated, dropped=dropped)
    assert moe_grouped_mm.use_triton_experts(x, w13, w2, ids)
    out = moe_grouped_mm.fused_experts_grouped_mm(x, w13, w2, ids, w, gated)
    assert _rel_err(out, fused_experts_torch(x, w13, w2, ids, w, gated)) < 2e-2
    assert torch.equal(out, moe_grouped_mm.fused_experts_grouped_mm(x, w13, w2, ids, w, gated))
    cutlass = moe_grouped_mm.fused_experts_grouped_mm(x, w13, w2, ids, w, gated, triton_grouped_gemm=False)
    assert _rel_err(out, cutlass) < 3e-2
    assert not moe_grouped_mm.use_triton_experts(x[:1024], w13, w2, ids[:1024])  # 64 pairs an expert

