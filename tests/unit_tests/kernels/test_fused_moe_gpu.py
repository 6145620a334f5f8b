"""Compiled fused MoE at the Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top-8,
moe_intermediate 768) vs the torch reference in bf16 and fp32, for decode and prefill token
counts, through the layer's own router at the decode and prefill counts of a step, and under
CUDA-graph capture (no host syncs, fixed shapes). Times: ``python -m benchmarks kernel-times fused-moe``."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import triton_fused_moe  # noqa: E402
from megatron_async.kernels.moe_torch import fused_experts_torch  # noqa: E402
from tests.helpers.moe_layers import qwen3_30b_moe_layer  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768


def _inputs(M, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, HIDDEN, device="cuda", generator=g).to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g) * HIDDEN ** -0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) * INTER ** -0.5).to(dtype)
    logits = torch.randn(M, EXPERTS, device="cuda", generator=g)
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    return x, w13, w2, ids.to(torch.int32), weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 16, 128, 1000])
def test_fused_moe_matches_the_reference_at_qwen3_30b_shapes(M, dtype):
    x, w13, w2, ids, w = _inputs(M, dtype, seed=M)
    out = triton_fused_moe.fused_experts(x, w13, w2, ids, w, True)
    ref = fused_experts_torch(x, w13, w2, ids, w, True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < tol


@pytest.fixture(scope="module")
def layer():
    return qwen3_30b_moe_layer()


def routed(layer, tokens: int, seed: int):
    """Fresh bf16 tokens routed by the layer's own router: (x, w13, w2, ids, weights)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    ids, weights = layer.gate.route(x)
    return x, layer.experts.gate_up_proj.weight, layer.experts.down_proj.weight, ids, weights


@pytest.mark.parametrize("tokens", [1, 8, 32, 128, 512, 2048])
def test_fused_moe_on_the_layers_routing(layer, tokens):
    """The layer's weights (N(0, 0.02)) and routing: within 3e-2 of the largest reference output."""
    with torch.no_grad():
        x, w13, w2, ids, w = routed(layer, tokens, seed=tokens)
        out = triton_fused_moe.fused_experts(x, w13, w2, ids, w, True)
        ref = fused_experts_torch(x, w13, w2, ids, w, True)
    assert float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < 3e-2


def test_fused_moe_replays_in_a_cuda_graph():
    x, w13, w2, ids, w = _inputs(64, torch.bfloat16, seed=1)
    triton_fused_moe.fused_experts(x, w13, w2, ids, w, True)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = triton_fused_moe.fused_experts(x, w13, w2, ids, w, True)
    torch.cuda.current_stream().wait_stream(stream)
    fresh = _inputs(64, torch.bfloat16, seed=2)  # new tokens and routing, same buffers
    x.copy_(fresh[0]), ids.copy_(fresh[3]), w.copy_(fresh[4])
    graph.replay()
    torch.cuda.synchronize()
    ref = triton_fused_moe.fused_experts(x, w13, w2, ids, w, True)
    assert torch.equal(out, ref)
