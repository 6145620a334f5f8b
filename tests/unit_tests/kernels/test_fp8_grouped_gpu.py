"""FP8 routed experts at prefill sizes on Hopper (``triton_fp8_grouped``: TMA over expert-sorted
rows) at the Qwen3-30B-A3B layer's shape against the fused FP8 MoE's kernels (the switch off: the
same bits) and the torch reference with the same quantization: SwiGLU and relu^2 experts, ids of no expert,
deterministic, replayed in a CUDA graph on new routing (the tile count read on the device)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import fp8_quant as fq  # noqa: E402
from megatron_async.kernels import triton_fp8_grouped  # noqa: E402
from megatron_async.kernels.moe_torch import fused_experts_torch  # noqa: E402
from megatron_async.kernels.triton_fp8_moe import fused_experts_fp8  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K_TOP = 128, 2048, 768, 8


def _inputs(tokens, gated=True, dropped=0.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13, s13 = fq.quantize_weight(torch.randn(E, 2 * I if gated else I, H, device="cuda", generator=g) * 0.02)
    w2, s2 = fq.quantize_weight(torch.randn(E, H, I, device="cuda", generator=g) * 0.03)
    x = torch.randn(tokens, H, device="cuda", generator=g).to(torch.bfloat16)
    w, ids = torch.softmax(torch.randn(tokens, E, device="cuda", generator=g), -1).topk(K_TOP, dim=-1)
    ids = ids.to(torch.int32)
    if dropped:
        ids = torch.where(torch.rand(ids.shape, device="cuda", generator=g) < dropped, ids + E, ids)
    return x, w13, s13, w2, s2, ids, w.float()


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("tokens, gated, dropped", [(4096, True, 0.0), (8192, True, 0.2), (4096, False, 0.1)])
def test_grouped_fp8_experts_match_the_fused_kernels_and_the_reference(tokens, gated, dropped):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA experts run on Hopper")
    x, w13, s13, w2, s2, ids, w = _inputs(tokens, gated, dropped, seed=tokens)
    assert triton_fp8_grouped.takes(x, w13, w2, ids, (128, 128))
    out = fused_experts_fp8(x, w13, s13, w2, s2, ids, w, gated)
    assert torch.equal(out, fused_experts_fp8(x, w13, s13, w2, s2, ids, w, gated))
    assert _rel(out, fused_experts_torch(x, w13, w2, ids, w, gated, s13, s2)) < 2e-2
    fused = fused_experts_fp8(x, w13, s13, w2, s2, ids, w, gated, triton_grouped_gemm=False)
    assert torch.equal(out, fused)  # the same arithmetic
    assert not triton_fp8_grouped.takes(x[:1024], w13, w2, ids[:1024], (128, 128))  # 64 pairs an expert


def test_grouped_fp8_experts_replay_in_a_cuda_graph():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA experts run on Hopper")
    x, w13, s13, w2, s2, ids, w = _inputs(8192, seed=1)
    fused_experts_fp8(x, w13, s13, w2, s2, ids, w, True)  # warm up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fused_experts_fp8(x, w13, s13, w2, s2, ids, w, True)
    torch.cuda.current_stream().wait_stream(stream)
    fresh = _inputs(8192, dropped=0.1, seed=2)
    x.copy_(fresh[0]), ids.copy_(fresh[5]), w.copy_(fresh[6])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_experts_fp8(x, w13, s13, w2, s2, ids, w, True))
    assert _rel(out, fused_experts_torch(x, w13, w2, ids, w, True, s13, s2)) < 2e-2
