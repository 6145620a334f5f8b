"""The FP8 fused MoE (triton_fp8_moe; interpreter on CPU, compiled on CUDA) against the emulated torch
loop (moe_torch with scales): SwiGLU and relu^2 experts, top-k 2 / 3, EP "no expert" ids, an
intermediate size that is not a multiple of 128 (one scale row per weight row); the slot sum
left to the next block's norm."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import fp8_quant as fq  # noqa: E402
from megatron_async.kernels.moe_experts import fused_experts  # noqa: E402
from megatron_async.kernels.moe_torch import fused_experts_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def experts(E, H, I, gated, g):
    """FP8 experts as a checkpoint stores them (gate / up each on its own grid), stacked: one
    128-row grid when I % 128 == 0, else one scale row per weight row. -> (w13, s13, w2, s2, sbn)."""
    parts = [torch.randn(E, I, H, generator=g) * 0.05 for _ in range(2 if gated else 1)]
    quantized = [fq.quantize_weight(p) for p in parts]
    q2, s2 = fq.quantize_weight(torch.randn(E, H, I, generator=g) * 0.05)
    q13 = torch.cat([q for q, _ in quantized], dim=1)
    if I % 128 == 0:
        return q13, torch.cat([s for _, s in quantized], dim=1), q2, s2, (128, 128)
    s13 = torch.cat([fq.row_scales(s, I) for _, s in quantized], dim=1)
    return q13, s13, q2, s2, (1, 128)


def routing(M, E, k, g, drop_some=False):
    w, ids = torch.softmax(torch.randn(M, E, generator=g), -1).topk(k, dim=-1)
    ids = ids.to(torch.int32)
    if drop_some:  # EP: ids outside [0, E) mean "another rank's expert"
        ids[::3, 0] = E + 1
    return ids, w.float()


@pytest.mark.parametrize("M,E,H,I,k,gated", [(1, 4, 256, 128, 2, True), (7, 4, 200, 256, 2, True),
                                             (33, 8, 128, 128, 3, False), (9, 3, 256, 130, 2, True)])
def test_fused_moe_fp8_against_emulated_loop(M, E, H, I, k, gated):
    g = torch.Generator().manual_seed(M * 10 + E)
    q13, s13, q2, s2, sbn = experts(E, H, I, gated, g)
    x = torch.randn(M, H, generator=g) * 2
    ids, w = routing(M, E, k, g, drop_some=M > 5)
    ref = fused_experts_torch(x, q13, w2=q2, topk_ids=ids, topk_weights=w, gated=gated, w13_scale=s13,
                              w2_scale=s2, scale_block_n=sbn)
    dev = [t.to(DEVICE) for t in (x, q13, q2, ids, w, s13, s2)]
    out = fused_experts(*dev[:5], gated, triton=True, w13_scale=dev[5], w2_scale=dev[6], scale_block_n=sbn)
    err, scale = (out.cpu() - ref).abs().max(), ref.abs().max()
    assert err <= (1e-5 if DEVICE == "cpu" else 1e-2) * scale, f"max err {err:.3g} of max |out| {scale:.3g}"


def test_a_wrong_expert_scale_is_seen():
    g = torch.Generator().manual_seed(2)
    q13, s13, q2, s2, sbn = experts(4, 128, 128, True, g)
    s13 = s13 * torch.tensor([1.0, 4.0, 0.25, 2.0])[:, None, None]
    x = torch.randn(6, 128, generator=g)
    ids, w = routing(6, 4, 2, g)
    ref = fused_experts_torch(x, q13, q2, ids, w, True, s13, s2, sbn)
    dev = [t.to(DEVICE) for t in (x, q13, q2, ids, w, s13.roll(1, dims=0), s2)]
    bad = fused_experts(*dev[:5], True, triton=True, w13_scale=dev[5], w2_scale=dev[6], scale_block_n=sbn)
    assert (bad.cpu() - ref).abs().max() > 1e-3 * ref.abs().max()


@pytest.mark.parametrize("M,E,H,I,k", [(20, 4, 200, 256, 2), (9, 3, 256, 130, 2)])
def test_tokens_quantized_once_or_per_pair_give_the_same_bits(M, E, H, I, k):
    """x quantized by its own pass (above SMALL_M tokens) or inside the gate_up GEMM for every pair
    and column tile: one bit pattern, EP "no expert" ids included."""
    from megatron_async.kernels.triton_fp8_moe import fused_experts_fp8

    g = torch.Generator().manual_seed(M + I)
    q13, s13, q2, s2, sbn = experts(E, H, I, True, g)
    x = (torch.randn(M, H, generator=g) * torch.linspace(0.01, 20, H)).to(torch.bfloat16)
    ids, w = routing(M, E, k, g, drop_some=True)
    dev = [t.to(DEVICE) for t in (x, q13, s13, q2, s2, ids, w)]
    once = fused_experts_fp8(*dev, True, sbn, prequantize=True)
    per_pair = fused_experts_fp8(*dev, True, sbn, prequantize=False)
    assert torch.equal(once, per_pair)


def test_launch_tiles_do_not_change_the_bits():
    """The tile table's entries (down's 128-column tiles: one weight-scale row a tile, loaded once)
    against 32-column tiles (the interpreter's): one bit pattern on CPU; on CUDA within rounding of
    the dot's accumulation order."""
    from megatron_async.kernels.triton_fp8_moe import FP8_MOE_TILES, Fp8MoeTiles, fused_experts_fp8

    g = torch.Generator().manual_seed(5)
    q13, s13, q2, s2, sbn = experts(3, 384, 256, True, g)
    x = torch.randn(12, 384, generator=g).to(torch.bfloat16)
    ids, w = routing(12, 3, 2, g, drop_some=True)
    dev = [t.to(DEVICE) for t in (x, q13, s13, q2, s2, ids, w)]
    wide = fused_experts_fp8(*dev, True, sbn, tiles=FP8_MOE_TILES[64]).float()
    narrow = fused_experts_fp8(*dev, True, sbn, tiles=Fp8MoeTiles(4, 3, 32, 4, 3)).float()
    if DEVICE == "cpu":
        assert torch.equal(wide, narrow)
    else:
        assert (wide - narrow).abs().max() <= 1e-2 * narrow.abs().max()


def test_wider_blocks_give_the_same_bits():
    """Experts' pairs aligned to 32 rows (CPU; 64 on CUDA: the prefill tiles) against 16-row blocks:
    one bit pattern on CPU, EP "no expert" ids included; on CUDA within rounding (the MMA shapes
    order the float32 sums differently, and a flipped rounding of an activation moves its e4m3
    step)."""
    from megatron_async.kernels.triton_fp8_moe import fused_experts_fp8

    g = torch.Generator().manual_seed(7)
    q13, s13, q2, s2, sbn = experts(3, 256, 256, True, g)
    x = torch.randn(40, 256, generator=g).to(torch.bfloat16)
    ids, w = routing(40, 3, 2, g, drop_some=True)
    dev = [t.to(DEVICE) for t in (x, q13, s13, q2, s2, ids, w)]
    wide = fused_experts_fp8(*dev, True, sbn, block_rows=32 if DEVICE == "cpu" else 64).float()
    narrow = fused_experts_fp8(*dev, True, sbn, block_rows=16).float()
    if DEVICE == "cpu":
        assert torch.equal(wide, narrow)
    else:
        assert (wide - narrow).abs().max() <= 3e-2 * narrow.abs().max()


def test_deferred_slot_sum_reduces_to_the_undeferred_output(monkeypatch):
    """``defer_combine``: the FP8 MoE's bf16 rows (one per pair) and routing as a ``PendingCombine``,
    whose sum and whose one-kernel sum + add + norm give the bits of the undeferred output then
    the norm, EP "no expert" ids included."""
    from megatron_async.kernels import fused_ops
    from megatron_async.kernels.moe_grouped_mm import PendingCombine
    from megatron_async.models.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(11)
    q13, s13, q2, s2, sbn = experts(4, 256, 256, True, g)
    x = torch.randn(10, 256, generator=g).to(torch.bfloat16)
    ids, w = routing(10, 4, 2, g, drop_some=True)
    dev = [t.to(DEVICE) for t in (x, q13, q2, ids, w, s13, s2)]
    now = fused_experts(*dev[:5], True, triton=True, w13_scale=dev[5], w2_scale=dev[6], scale_block_n=sbn)
    later = fused_experts(*dev[:5], True, triton=True, defer_combine=True, w13_scale=dev[5], w2_scale=dev[6],
                          scale_block_n=sbn)
    assert isinstance(later, PendingCombine) and later.y.shape == (20, 256) and later.y.dtype == torch.bfloat16
    assert torch.equal(later.reduce(), now)
    monkeypatch.setattr(fused_ops, "use_fused", lambda t, enabled=True: enabled)  # the kernels, interpreted on CPU
    norm = RMSNorm(256, 1e-6, torch.bfloat16, DEVICE)
    residual = torch.randn(10, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    from megatron_async.kernels.moe_grouped_mm import combine_fuses_norm

    assert combine_fuses_norm(later, residual, norm.weight)  # the one-kernel path, not a reduce first
    fused = norm.add_and_norm(later, residual)
    assert all(torch.equal(a, b) for a, b in zip(fused, norm.add_and_norm(later.reduce(), residual)))


def test_either_alignment_gives_the_same_bits(monkeypatch):
    """The plan's alignment kernels (``triton_fused_moe.PLAN_MIN_READS`` 0) and the one-program-per-expert
    kernel: the FP8 fused MoE's output bit for bit, with an expert left without pairs and EP ids."""
    from megatron_async.kernels import triton_fused_moe, triton_moe_plan
    from megatron_async.kernels.triton_fp8_moe import fused_experts_fp8

    g = torch.Generator().manual_seed(9)
    q13, s13, q2, s2, sbn = experts(5, 256, 256, True, g)
    x = torch.randn(30, 256, generator=g).to(torch.bfloat16)
    ids, w = routing(30, 5, 2, g, drop_some=True)
    ids[ids == 3] = 0
    dev = [t.to(DEVICE) for t in (x, q13, s13, q2, s2, ids, w)]
    calls = []
    real = triton_moe_plan.align_pairs
    monkeypatch.setattr(triton_moe_plan, "align_pairs", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(triton_fused_moe, "PLAN_MIN_READS", 1 << 60)
    one_kernel = fused_experts_fp8(*dev, True, sbn)
    assert not calls
    monkeypatch.setattr(triton_fused_moe, "PLAN_MIN_READS", 0)
    assert torch.equal(fused_experts_fp8(*dev, True, sbn), one_kernel) and calls


def test_rows_per_block_skips_the_middle_size():
    """16 rows up to 16 pairs an expert (decode), 64 above (the measured faster blocks from 24 on)."""
    from megatron_async.kernels.triton_fp8_moe import FP8_MOE_TILES, rows_per_block

    assert rows_per_block(128 * 8, 128) == 16 and rows_per_block(256 * 8, 128) == 16 and rows_per_block(1, 128) == 16
    assert rows_per_block(257 * 8, 128) == 64 and rows_per_block(1024 * 8, 128) == 64 and rows_per_block(40, 2) == 64
    assert {rows_per_block(n, 128) for n in range(1, 40000, 97)} <= set(FP8_MOE_TILES)
