"""Fused Triton MoE (sort-by-expert alignment + two grouped GEMMs with the SiLU-mul and the
routing weights fused) vs the torch reference loop, on fresh random inputs: float32 and
bfloat16, SwiGLU and relu^2 experts, ids meaning "no expert" (EP / padding rows), shapes that
do not divide the blocks. In Triton's interpreter on CPU, compiled on CUDA."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import launch_limits, triton_fused_moe  # noqa: E402
from megatron_async.kernels.moe_torch import fused_experts_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(M, K, I, H, E, k, dtype, gated, seed, dropped=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * I if gated else I, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]) if M else torch.zeros(0, k)
    ids = ids.to(torch.int32)
    if dropped:  # another rank's expert or a padding row: E or beyond, or negative
        drop = torch.rand(ids.shape, generator=g) < dropped
        ids = torch.where(drop, torch.randint(E, 2 * E, ids.shape, generator=g).to(torch.int32), ids)
        ids[0, 0] = -3
    w = torch.rand(M, k, generator=g)
    return x, w13, w2, ids.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("M, E, k, block_m", [(1, 8, 2, 16), (7, 4, 2, 16), (40, 8, 3, 16), (33, 128, 8, 32)])
def test_alignment_puts_every_routed_pair_once_in_a_block_of_its_expert(M, E, k, block_m):
    g = torch.Generator().manual_seed(M)
    ids = torch.randint(-1, E + 2, (M, k), generator=g).to(torch.int32)
    sorted_pairs, block_expert = triton_fused_moe.align_by_expert(ids.to(DEVICE), E, block_m)
    sorted_pairs, block_expert = sorted_pairs.cpu(), block_expert.cpu()
    n = M * k
    assert sorted_pairs.numel() >= n + min(E, n) * (block_m - 1) and sorted_pairs.numel() % block_m == 0
    flat = ids.flatten()
    routed = [(p, int(flat[p])) for p in range(n) if 0 <= flat[p] < E]
    seen = {}
    for row, pair in enumerate(sorted_pairs.tolist()):
        if pair == n:
            continue
        assert pair not in seen
        seen[pair] = int(block_expert[row // block_m])
    assert sorted(seen.items()) == routed
    assert ((block_expert >= 0) & (block_expert <= E)).all()


CASES = [  # M, K, I, H, E, k, gated, dropped
    (1, 32, 24, 40, 4, 2, True, 0.0),
    (9, 48, 16, 32, 8, 3, True, 0.3),
    (12, 32, 40, 24, 6, 2, False, 0.2),
    (70, 64, 32, 64, 8, 2, True, 0.0),
    (160, 32, 32, 32, 4, 2, True, 0.1),  # 80 pairs per expert: prefill-size blocks of 64 and their tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, K, I, H, E, k, gated, dropped", CASES)
def test_fused_moe_matches_the_reference(M, K, I, H, E, k, gated, dropped, dtype):
    x, w13, w2, ids, w = _inputs(M, K, I, H, E, k, dtype, gated, seed=M * 7 + E, dropped=dropped)
    out = triton_fused_moe.fused_experts(x, w13, w2, ids, w, gated)
    ref = fused_experts_torch(x, w13, w2, ids, w, gated)
    assert out.dtype == dtype and out.shape == (M, H)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    scale = ref.float().abs().max().clamp(min=1e-6)
    assert float((out.float() - ref.float()).abs().max() / scale) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_equal_contiguous_rows(dtype):
    """The EP exchange hands the experts a column slice of its packed all-gather (tokens, then
    the routing's bits): the kernel reads rows by their stride, with no copy, bit for bit."""
    x, w13, w2, ids, w = _inputs(9, 48, 16, 32, 8, 3, dtype, True, seed=5, dropped=0.2)
    wide = torch.cat([x, torch.randn(9, 6).to(DEVICE, dtype)], dim=1)
    strided = wide[:, :48]
    assert strided.stride(0) == 54
    out = triton_fused_moe.fused_experts(strided, w13, w2, ids, w, True)
    assert torch.equal(out, triton_fused_moe.fused_experts(x, w13, w2, ids, w, True))


def test_no_tokens_and_all_dropped():
    x, w13, w2, ids, w = _inputs(3, 32, 16, 16, 4, 2, torch.float32, True, seed=1)
    assert triton_fused_moe.fused_experts(x[:0], w13, w2, ids[:0], w[:0], True).shape == (0, 16)
    out = triton_fused_moe.fused_experts(x, w13, w2, torch.full_like(ids, 4), w, True)
    assert torch.equal(out, torch.zeros_like(out))


def test_moe_layer_runs_the_fused_kernel_under_the_triton_backend(monkeypatch):
    from megatron_async.kernels.backends import KernelBackends
    from megatron_async.models.layers.block import StepInputs
    from megatron_async.parallel.state import ParallelState
    from tests.helpers.moe_layers import MOE_CONFIGS, build_moe_layer

    calls = []
    real = triton_fused_moe.fused_experts
    monkeypatch.setattr(triton_fused_moe, "fused_experts", lambda *a: calls.append(1) or real(*a))
    layer = build_moe_layer(MOE_CONFIGS["softmax"], 32, ParallelState(), device=DEVICE)
    x = torch.randn(6, 32, device=DEVICE)
    ref = layer(x, StepInputs(None, None, None, kernels=KernelBackends(attention="torch")))
    assert not calls
    out = layer(x, StepInputs(None, None, None, kernels=KernelBackends(attention="triton")))
    assert calls
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("M, E, k, block_m", [(1, 8, 2, 16), (7, 4, 2, 16), (40, 8, 3, 16), (33, 128, 8, 32),
                                              (300, 6, 2, 64), (700, 16, 2, 16)])  # 1,400 pairs: two chunks
def test_triton_alignment_equals_the_torch_alignment(M, E, k, block_m):
    g = torch.Generator().manual_seed(M + E)
    ids = torch.randint(-1, E + 2, (M, k), generator=g).to(torch.int32).to(DEVICE)
    ref_pairs, ref_blocks = triton_fused_moe.align_by_expert(ids, E, block_m)
    pairs, blocks = triton_fused_moe.align_by_expert_triton(ids, E, block_m)
    assert torch.equal(blocks, ref_blocks)
    live = (blocks < E).repeat_interleave(block_m)  # rows of blocks past the end are never read
    assert torch.equal(pairs[live], ref_pairs[live])


@pytest.mark.parametrize("M, E, k, block_m, seg", [(1, 8, 2, 16, None), (40, 8, 3, 16, 16), (33, 128, 8, 32, None),
                                                   (300, 6, 2, 64, 64), (700, 16, 2, 16, 128)])
def test_plan_alignment_equals_the_torch_alignment(M, E, k, block_m, seg):
    """The plan's kernels in the fused MoE's layout (``triton_moe_plan.align_pairs``): the torch
    alignment's blocks and rows, with one segment and with several (counts carried between programs),
    experts left without pairs, ids of no expert."""
    from megatron_async.kernels import triton_moe_plan

    g = torch.Generator().manual_seed(M + 7 * E)
    ids = torch.randint(-1, E + 2, (M, k), generator=g).to(torch.int32)
    ids[ids == E // 2] = 0  # an expert with no pair: no rows (the grouped GEMM's plan gives it a block)
    ref_pairs, ref_blocks = triton_fused_moe.align_by_expert(ids, E, block_m)
    pairs, blocks = triton_moe_plan.align_pairs(ids.to(DEVICE), E, block_m, seg)
    assert torch.equal(blocks.cpu(), ref_blocks)
    live = (ref_blocks < E).repeat_interleave(block_m)
    assert torch.equal(pairs.cpu()[live], ref_pairs[live])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_either_alignment_gives_the_same_bits(monkeypatch, dtype):
    """``align_pairs`` takes the plan's kernels from ``PLAN_MIN_READS`` (here from any size) and the
    one-program-per-expert kernel below it (here always): the fused MoE's output bit for bit."""
    from megatron_async.kernels import triton_moe_plan

    x, w13, w2, ids, w = _inputs(70, 64, 32, 64, 8, 2, dtype, True, seed=11, dropped=0.2)
    calls = []
    real = triton_moe_plan.align_pairs
    monkeypatch.setattr(triton_moe_plan, "align_pairs", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(triton_fused_moe, "PLAN_MIN_READS", 1 << 60)
    one_kernel = triton_fused_moe.fused_experts(x, w13, w2, ids, w, True)
    assert not calls
    monkeypatch.setattr(triton_fused_moe, "PLAN_MIN_READS", 0)
    plan = triton_fused_moe.fused_experts(x, w13, w2, ids, w, True)
    assert calls and torch.equal(plan, one_kernel)


def test_tiles_follow_the_block_size_and_the_shared_memory():
    assert triton_fused_moe._block_m(320, 4) == 64 and triton_fused_moe._block_m(16, 8) == 16
    tiles, unlimited = triton_fused_moe.default_tiles, launch_limits.INTERPRETER
    assert tiles(16, 2, 2, 2, unlimited) == triton_fused_moe._DECODE_TILES
    assert tiles(64, 2, 2, 2, unlimited) == triton_fused_moe._PREFILL_TILES
    assert tiles(32, 2, 2, 2, unlimited) == triton_fused_moe.GemmTiles()
    # 3 stages of a bf16 64 x 64 A tile and two 64 x 256 B tiles: 216 KiB, over a 163 KiB opt-in (A100),
    # under 227 (H100); on 2 stages 144 KiB
    a100, h100 = launch_limits.DeviceLimits(163 * 1024), launch_limits.DeviceLimits(227 * 1024)
    assert tiles(64, 2, 2, 2, a100) == dataclasses.replace(triton_fused_moe._PREFILL_TILES, num_stages=2)
    assert tiles(64, 1, 2, 2, a100) == triton_fused_moe._PREFILL_TILES  # one B tile: 120 KiB
    assert tiles(64, 2, 2, 2, h100) == triton_fused_moe._PREFILL_TILES