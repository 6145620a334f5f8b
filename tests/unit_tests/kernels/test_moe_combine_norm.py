"""The grouped-GEMM MoE's slot sum left to the next block's norm (``moe_grouped_mm.PendingCombine``):
the one-kernel slot sum + residual add + RMSNorm (interpreted on CPU, compiled on CUDA) gives
the bits of ``combine_slots`` then ``add_rms_norm`` on fresh random inputs (rows of no expert
full of NaN, several token counts and top-k, both norm orders) and stays within bf16 rounding
of the torch references; ``RMSNorm.add_and_norm`` takes that kernel exactly where it applies
and reduces first elsewhere; a MoE mixer defers only as a block's mixer with nothing after its
routed experts, and its deferred sum reduces to the output it returns undeferred. Rows in pair
order (the FP8 MoE's, ``row_of_pair`` None) read as those rows spelled out."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import fused_ops, moe_experts, moe_grouped_mm  # noqa: E402
from megatron_async.kernels.backends import KernelBackends  # noqa: E402
from megatron_async.kernels.moe_grouped_mm import PendingCombine, combine_slots_torch, plan_rows  # noqa: E402
from megatron_async.models.layers.block import Block, StepInputs  # noqa: E402
from megatron_async.models.layers.norm import NemotronRMSNorm, RMSNorm  # noqa: E402
from megatron_async.parallel.state import ParallelState  # noqa: E402
from tests.helpers.moe_layers import SIGMOID_MOE, SOFTMAX_MOE, build_moe_layer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pending(M, k, E, H, dtype, seed) -> PendingCombine:
    """Random routing (some pairs of no expert, NaN weights there) and expert rows, NaN where no
    pair points (the grouped GEMM leaves those rows unwritten)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2, E + 2, (M, k), generator=g).to(torch.int32)
    w = torch.where((ids >= 0) & (ids < E), torch.rand(M, k, generator=g), float("nan"))
    row_of_pair, _, _ = plan_rows(ids, E)
    y = torch.full((M * k + E * moe_grouped_mm.ROW_ALIGN, H), float("nan"), dtype=dtype)
    routed = row_of_pair < y.shape[0]
    y[row_of_pair[routed]] = torch.randn(int(routed.sum()), H, generator=g).to(dtype)
    return PendingCombine(y.to(DEVICE), row_of_pair.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), E, dtype)


def _norm_inputs(M, H, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    residual = torch.randn(M, H, generator=g).to(dtype).to(DEVICE)
    weight = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype).to(DEVICE)
    return residual, weight


CASES = [  # M, k, E, H, dtype, cast_before_weight
    (7, 3, 5, 40, torch.bfloat16, True),  # a row width of no power of two (masked columns)
    (16, 8, 16, 64, torch.bfloat16, False),
    (1, 1, 4, 32, torch.bfloat16, True),
    (33, 2, 8, 48, torch.bfloat16, True),
    (9, 4, 6, 24, torch.float32, True),
]


@pytest.mark.parametrize("M, k, E, H, dtype, cast_before_weight", CASES)
def test_fused_kernel_equals_combine_then_add_rms_norm(M, k, E, H, dtype, cast_before_weight):
    from megatron_async.kernels import triton_moe_combine, triton_rmsnorm

    p = _pending(M, k, E, H, dtype, seed=M * 13 + k)
    residual, weight = _norm_inputs(M, H, dtype, seed=M)
    out, res_out = triton_moe_combine.combine_add_rms_norm(p.y, p.row_of_pair, p.topk_ids, p.topk_weights, E,
                                                           residual, weight, 1e-6, cast_before_weight)
    s = triton_moe_combine.combine_slots(p.y, p.row_of_pair, p.topk_ids, p.topk_weights, E, dtype)
    ref_out, ref_res = triton_rmsnorm.add_rms_norm(s, residual, weight, 1e-6, cast_before_weight)
    assert torch.isfinite(out).all() and torch.isfinite(res_out).all()
    assert torch.equal(res_out, ref_res) and torch.equal(out, ref_out)  # bit for bit
    # the torch references (the interpreter rounds float32 to bf16 by truncation, so a bf16 ulp or two)
    torch_sum = combine_slots_torch(p.y, p.row_of_pair, p.topk_ids, p.topk_weights, E, dtype)
    norm = (RMSNorm if cast_before_weight else NemotronRMSNorm)(H, 1e-6, dtype, DEVICE)
    norm.weight.data.copy_(weight)
    torch_res = torch_sum + residual
    torch_out = norm._torch(torch_res)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in ((res_out, torch_res), (out, torch_out)):
        assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < tol


@pytest.mark.parametrize("M, k, E, H", [(7, 3, 5, 40), (16, 8, 16, 64)])
def test_rows_in_pair_order_read_as_the_pairs_rows(M, k, E, H):
    """``row_of_pair`` None (the FP8 MoE's rows, one per pair in pair order): the kernels read row
    t * k + j for pair t * k + j, as with those rows spelled out; rows of no expert stay unread."""
    from megatron_async.kernels import triton_moe_combine

    p = _pending(M, k, E, H, torch.bfloat16, seed=M + 3 * k)
    routed = (p.topk_ids >= 0) & (p.topk_ids < E)
    y = torch.full((M * k, H), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    y[routed.reshape(-1)] = p.y[p.row_of_pair[routed.reshape(-1)]]
    rows = torch.arange(M * k, dtype=torch.int32, device=DEVICE)
    want = triton_moe_combine.combine_slots(y, rows, p.topk_ids, p.topk_weights, E, torch.bfloat16)
    got = triton_moe_combine.combine_slots(y, None, p.topk_ids, p.topk_weights, E, torch.bfloat16)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert torch.equal(got, triton_moe_combine.combine_slots(p.y, p.row_of_pair, p.topk_ids, p.topk_weights, E,
                                                             torch.bfloat16))
    assert torch.equal(combine_slots_torch(y, None, p.topk_ids, p.topk_weights, E, torch.bfloat16),
                       combine_slots_torch(y, rows, p.topk_ids, p.topk_weights, E, torch.bfloat16))
    residual, weight = _norm_inputs(M, H, torch.bfloat16, seed=M)
    fused = triton_moe_combine.combine_add_rms_norm(y, None, p.topk_ids, p.topk_weights, E, residual, weight, 1e-6,
                                                    True)
    spelled = triton_moe_combine.combine_add_rms_norm(y, rows, p.topk_ids, p.topk_weights, E, residual, weight,
                                                      1e-6, True)
    assert all(torch.equal(a, b) for a, b in zip(fused, spelled))


def test_no_tokens_and_misfit_tensors():
    from megatron_async.kernels import triton_moe_combine

    p = _pending(4, 2, 4, 16, torch.bfloat16, seed=5)
    residual, weight = _norm_inputs(4, 16, torch.bfloat16, seed=5)
    out, res = triton_moe_combine.combine_add_rms_norm(p.y, p.row_of_pair[:0], p.topk_ids[:0], p.topk_weights[:0],
                                                       4, residual[:0], weight, 1e-6, True)
    assert out.shape == res.shape == (0, 16)
    with pytest.raises(ValueError, match="do not fit"):
        triton_moe_combine.combine_add_rms_norm(p.y, p.row_of_pair, p.topk_ids, p.topk_weights, 4, residual[:3],
                                                weight, 1e-6, True)


def _spy_fused(monkeypatch) -> list[int]:
    from megatron_async.kernels import triton_moe_combine

    calls, real = [], triton_moe_combine.combine_add_rms_norm
    monkeypatch.setattr(triton_moe_combine, "combine_add_rms_norm", lambda *a: calls.append(1) or real(*a))
    return calls


def test_norm_takes_the_fused_kernel_where_it_applies_and_reduces_elsewhere(monkeypatch):
    calls = _spy_fused(monkeypatch)
    M, H = 11, 32
    p = _pending(M, 3, 6, H, torch.bfloat16, seed=8)
    residual, weight = _norm_inputs(M, H, torch.bfloat16, seed=8)
    norm = RMSNorm(H, 1e-6, torch.bfloat16, DEVICE)
    norm.weight.data.copy_(weight)
    assert torch.equal(p.reduce(), moe_grouped_mm.combine_slots(p.y, p.row_of_pair, p.topk_ids, p.topk_weights, 6,
                                                                torch.bfloat16))
    if DEVICE == "cpu":  # no fused kernels on CPU tensors: the norm reduces first, as the torch path does
        expect = norm.add_and_norm(p.reduce(), residual)
        assert all(torch.equal(a, b) for a, b in zip(norm.add_and_norm(p, residual), expect)) and not calls
        monkeypatch.setattr(fused_ops, "use_fused", lambda x, enabled=True: enabled)  # the kernels, interpreted
    got = norm.add_and_norm(p, residual)
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(got, norm.add_and_norm(p.reduce(), residual)))
    # a float32 residual stream (Mamba2's residual_in_fp32): summed in float32 after the reduce
    got = norm.add_and_norm(p, residual.float())
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(got, norm.add_and_norm(p.reduce(), residual.float())))
    assert not moe_grouped_mm.combine_fuses_norm(p, residual[:5], weight)  # shapes that do not fit: reduce


def _step(fused: bool = True) -> StepInputs:
    return StepInputs(None, None, None, kernels=KernelBackends(attention="triton", fused=fused))


def test_moe_mixer_defers_as_a_block_mixer_with_nothing_after_its_experts(monkeypatch):
    monkeypatch.setattr(moe_experts, "use_grouped_mm", lambda *a: True)  # the grouped GEMM's CPU fallback here
    layer = build_moe_layer(SOFTMAX_MOE, 16, ParallelState())
    x = torch.randn(9, 16)
    alone = layer(x, _step())
    assert isinstance(alone, torch.Tensor)  # not a block's mixer: a tensor for whoever reads it
    Block(RMSNorm(16, 1e-6, torch.float32, "cpu"), layer)
    assert layer.defers_combine(_step().kernels)
    deferred = layer(x, _step())
    assert isinstance(deferred, PendingCombine) and torch.equal(deferred.reduce(), alone)
    assert isinstance(layer(x, _step(fused=False)), torch.Tensor)  # the torch norm reference keeps its tensor
    assert isinstance(layer(x, StepInputs(None, None, None)), torch.Tensor)  # the torch experts
    shared = build_moe_layer(SIGMOID_MOE, 16, ParallelState())  # shared expert and latent projections after them
    Block(RMSNorm(16, 1e-6, torch.float32, "cpu"), shared)
    assert not shared.defers_combine(_step().kernels) and isinstance(shared(x, _step()), torch.Tensor)
    tp = build_moe_layer(SOFTMAX_MOE, 16, ParallelState(tp_rank=0, tp_size=2))
    Block(RMSNorm(16, 1e-6, torch.float32, "cpu"), tp)
    assert not tp.defers_combine(_step().kernels)  # the TP sum comes after the experts
