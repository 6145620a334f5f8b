"""Routed experts through torch's grouped GEMM (``moe_grouped_mm``) vs the torch reference loop,
on fresh random inputs: ids meaning "no expert" (EP / padding rows), experts with no token,
one token, top-1 and top-8, SwiGLU and relu^2 experts; the row plan; the combine kernel (in
Triton's interpreter on CPU) against its torch reference; which batches the dispatch hands to
it. CPU: the grouped GEMM's fallback (float32, and bf16 with 16-byte rows)."""
from __future__ import annotations

import pytest
import torch

from megatron_async.kernels import moe_experts, moe_grouped_mm
from megatron_async.kernels.moe_grouped_mm import fused_experts_grouped_mm, plan_rows
from megatron_async.kernels.moe_torch import fused_experts_torch

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")


def _inputs(M, K, I, H, E, k, dtype, gated, seed, dropped=0.0, experts_used=None):
    """Random tokens, weights and routing; ``experts_used`` < E leaves the other experts empty."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I if gated else I, K, generator=g) / K ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    used = experts_used or E
    ids = torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    if dropped:  # another rank's expert or a padding row: E or beyond, or negative
        drop = torch.rand(ids.shape, generator=g) < dropped
        ids = torch.where(drop, torch.randint(E, 2 * E, ids.shape, generator=g).to(torch.int32), ids)
        ids[0, 0] = -3
    w = torch.rand(M, k, generator=g)
    return x, w13, w2, ids, w


CASES = [  # M, K, I, H, E, k, gated, dropped, experts_used
    (1, 32, 24, 40, 4, 2, True, 0.0, None),
    (1, 16, 16, 16, 8, 1, False, 0.0, None),
    (9, 48, 16, 32, 8, 3, True, 0.3, None),
    (12, 32, 40, 24, 6, 2, False, 0.2, None),
    (20, 32, 16, 32, 16, 8, True, 0.2, 10),  # top-8 of 10 used experts: 6 experts get no token
    (70, 64, 32, 64, 8, 1, True, 0.0, 3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, K, I, H, E, k, gated, dropped, experts_used", CASES)
def test_grouped_mm_experts_match_the_reference(M, K, I, H, E, k, gated, dropped, experts_used, dtype):
    x, w13, w2, ids, w = _inputs(M, K, I, H, E, k, dtype, gated, M * 7 + E, dropped, experts_used)
    out = fused_experts_grouped_mm(x, w13, w2, ids, w, gated)
    ref = fused_experts_torch(x, w13, w2, ids, w, gated)
    assert out.dtype == dtype and out.shape == (M, H)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    scale = ref.float().abs().max().clamp(min=1e-6)
    assert float((out.float() - ref.float()).abs().max() / scale) < tol
    assert torch.equal(out, fused_experts_grouped_mm(x, w13, w2, ids, w, gated))  # deterministic


def test_tokens_of_no_expert_get_zeros_and_no_tokens_give_an_empty_result():
    x, w13, w2, ids, w = _inputs(5, 16, 8, 16, 4, 2, torch.float32, True, seed=3)
    w[0, 0] = float("nan")  # a weight of no expert is never read
    ids[0] = torch.tensor([4, -1], dtype=torch.int32)
    out = fused_experts_grouped_mm(x, w13, w2, ids, w, True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out).all()
    assert fused_experts_grouped_mm(x[:0], w13, w2, ids[:0], w[:0], True).shape == (0, 16)
    out = fused_experts_grouped_mm(x, w13, w2, torch.full_like(ids, 7), w, True)
    assert torch.equal(out, torch.zeros_like(out))


def test_plan_puts_every_routed_pair_once_in_its_experts_aligned_rows():
    E, k, A = 6, 3, moe_grouped_mm.ROW_ALIGN
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(-1, E - 2, (23, k), generator=g).to(torch.int32)  # experts E-2, E-1 get nothing
    row_of_pair, token_of_row, offs = plan_rows(ids, E)
    n, P = ids.numel(), ids.numel() + E * A
    assert token_of_row.shape == (P,) and offs.dtype == torch.int32
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert (sizes % A == 0).all() and (sizes >= A).all() and int(offs[-1]) <= P
    flat = ids.flatten()
    for e in range(E):
        pairs = [p for p in range(n) if flat[p] == e]
        rows = [int(row_of_pair[p]) for p in pairs]
        start = int(offs[e - 1]) if e else 0
        assert rows == list(range(start, start + len(pairs)))  # pair order within the expert
        assert [int(token_of_row[r]) for r in rows] == [p // k for p in pairs]
    assert all(int(row_of_pair[p]) == P for p in range(n) if not 0 <= flat[p] < E)


def test_gather_kernel_copies_the_rows_of_the_groups():
    pytest.importorskip("triton")
    from megatron_async.kernels import triton_moe_plan

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    M, k, E, K = 9, 3, 5, 40
    ids = torch.randint(-1, E, (M, k), generator=g).to(torch.int32)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    _, token_of_row, offs = moe_grouped_mm.plan_rows_torch(ids, E)
    out = triton_moe_plan.gather_rows(x.to(device), token_of_row.to(device), offs.to(device), rows=4, block_k=16)
    end = int(offs[-1])
    assert torch.equal(out[:end].cpu(), x.index_select(0, token_of_row)[:end])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_kernel_matches_its_torch_reference(dtype):
    """The Triton kernel (interpreted on CPU, compiled on CUDA) against the torch ops, over rows
    full of NaN where no pair points (as the grouped GEMM leaves them)."""
    pytest.importorskip("triton")
    from megatron_async.kernels import triton_moe_combine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(2)
    M, k, E, H = 7, 3, 5, 40
    ids = torch.randint(-2, E + 2, (M, k), generator=g).to(torch.int32)
    w = torch.where((ids >= 0) & (ids < E), torch.rand(M, k, generator=g), float("nan"))  # weights of no expert: unread
    row_of_pair, _, offs = plan_rows(ids, E)
    y = torch.full((M * k + E * moe_grouped_mm.ROW_ALIGN, H), float("nan"), dtype=dtype)
    routed = row_of_pair < y.shape[0]
    y[row_of_pair[routed]] = torch.randn(int(routed.sum()), H, generator=g).to(dtype)
    y, row_of_pair, ids, w = y.to(device), row_of_pair.to(device), ids.to(device), w.to(device)
    ref = moe_grouped_mm.combine_slots_torch(y, row_of_pair, ids, w, E, dtype)
    out = triton_moe_combine.combine_slots(y, row_of_pair, ids, w, E, dtype)
    assert torch.isfinite(ref).all()
    assert float((out.float() - ref.float()).abs().max()) <= (1e-6 if dtype == torch.float32 else 1e-2)


def test_dispatch_takes_prefill_sized_bf16_batches_with_aligned_rows():
    x, w13, w2, ids, _ = _inputs(300, 32, 16, 32, 8, 2, torch.bfloat16, True, seed=1)  # 75 pairs per expert
    assert moe_grouped_mm.MIN_PAIRS_PER_EXPERT == 32

    def suits(**kw):
        return moe_grouped_mm.grouped_mm_suits(**{"x": x, "w13": w13, "w2": w2, "topk_ids": ids, **kw})

    assert suits()
    assert not moe_grouped_mm.use_grouped_mm(x, w13, w2, ids)  # on CPU (and in the interpreter): never
    assert suits(topk_ids=ids[:132]) and not suits(topk_ids=ids[:128])  # 33 / 32 pairs per expert
    assert not suits(x=x.float(), w13=w13.float(), w2=w2.float())
    assert not suits(x=x[:, :20], w13=w13[:, :, :20].contiguous())  # K = 20: rows of 40 bytes
    assert not suits(w13=w13.transpose(1, 2).contiguous().transpose(1, 2))  # K-major copies: no unit last stride
    shifted = torch.empty(w2.numel() + 8, dtype=w2.dtype)[1:1 + w2.numel()].view_as(w2)
    assert suits(w2=shifted.new_empty(w2.shape)) and not suits(w2=shifted)  # starts 2 bytes off 16


def test_the_triton_backend_runs_the_grouped_gemm_where_the_dispatch_says(monkeypatch):
    calls = []
    monkeypatch.setattr(moe_experts, "use_grouped_mm", lambda *a: True)
    real = moe_experts.fused_experts_grouped_mm
    monkeypatch.setattr(moe_experts, "fused_experts_grouped_mm", lambda *a: calls.append(1) or real(*a))
    x, w13, w2, ids, w = _inputs(9, 32, 16, 32, 8, 2, torch.float32, True, seed=4)
    out = moe_experts.fused_experts(x, w13, w2, ids, w, True, triton=True)
    assert calls
    ref = fused_experts_torch(x, w13, w2, ids, w, True)
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5
    moe_experts.fused_experts(x, w13, w2, ids, w, True, triton=False)
    assert len(calls) == 1  # the torch backend never asks
    off = moe_experts.fused_experts(x, w13, w2, ids, w, True, triton=True, grouped_mm=False)
    assert len(calls) == 1  # a model with moe_grouped_mm off stays on the fused Triton MoE
    assert float((off - ref).abs().max() / ref.abs().max()) < 1e-5


def test_the_triton_grouped_gemm_switch_keeps_the_grouped_path_on_torch(monkeypatch):
    asked = []
    monkeypatch.setattr(moe_grouped_mm, "use_triton_experts", lambda *a: asked.append(1) or False)
    x, w13, w2, ids, w = _inputs(9, 32, 16, 32, 8, 2, torch.float32, True, seed=5)
    ref = fused_experts_torch(x, w13, w2, ids, w, True)
    on = fused_experts_grouped_mm(x, w13, w2, ids, w, True)
    assert asked == [1]
    off = fused_experts_grouped_mm(x, w13, w2, ids, w, True, triton_grouped_gemm=False)
    assert asked == [1] and torch.equal(on, off)  # never asked: torch's grouped GEMM
    assert float((off - ref).abs().max() / ref.abs().max()) < 1e-5
