"""Activations handed to the FP8 linear already quantized (triton_fp8_act; interpreted on CPU,
compiled on CUDA): SwiGLU + quantize and (add +) RMSNorm + quantize in one kernel give the bits of
the unfused kernels then ``quantize_activation`` (padding rows zeros), the FP8 linear over those
rows gives the bits of the linear over the bf16 activation, and the SwiGLU MLP and a block's norm
take the one-kernel paths exactly where the linear would quantize in a pass of its own (on CUDA)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import fp8_quant as fq, fused_ops, triton_act  # noqa: E402
from megatron_async.kernels import triton_fp8_act as fa, triton_fp8_gemm as tg  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gate_up(m: int, inter: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * inter, generator=g) * torch.linspace(0.05, 6, 2 * inter)
    return x.to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("m,inter", [(1, 128), (7, 200), (33, 384), (130, 256)])
def test_silu_and_mul_quantized_equals_the_two_passes(m, inter):
    gate_up = _gate_up(m, inter, seed=m + inter)
    rows = fa.silu_and_mul_quantized(gate_up)
    q, s = tg.quantize_activation(triton_act.silu_and_mul(gate_up), pad_rows_to=fa.PAD_ROWS)
    assert rows.m == m and rows.shape == (m, inter) and rows.dtype == torch.bfloat16
    assert rows.q.shape == q.shape and rows.scale.stride() == s.stride()
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rows.scale, s)
    assert not rows.q[m:].float().any()  # padding rows are zeros


@pytest.mark.parametrize("m,inter", [(1, 128), (7, 200), (130, 256)])
def test_relu_square_matches_torch_and_its_quantized_form_the_two_passes(m, inter):
    """bf16 on CUDA (a bf16 square is exact in float32: one rounding gives torch's bits); float32 under
    the interpreter, which rounds float32 to bf16 by truncation."""
    g = torch.Generator().manual_seed(m * inter)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    h = (torch.randn(m, inter, generator=g) * torch.linspace(0.05, 30, inter)).to(dtype).to(DEVICE)
    act = triton_act.relu_square(h)
    assert torch.equal(act, torch.relu(h).square())
    rows = fa.relu_square_quantized(h)
    q, s = tg.quantize_activation(act, pad_rows_to=fa.PAD_ROWS)
    assert rows.m == m and rows.shape == (m, inter)
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rows.scale, s)


@pytest.mark.parametrize("m,n,residual,cast_first", [(1, 128, True, True), (7, 200, True, False), (33, 256, False, True),
                                                     (130, 384, True, True)])
def test_rms_norm_quantized_equals_the_norm_then_the_quantize(m, n, residual, cast_first):
    from megatron_async.kernels import triton_rmsnorm

    g = torch.Generator().manual_seed(m + n)
    x = (torch.randn(m, n, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    r = (torch.randn(m, n, generator=g) * 3).to(torch.bfloat16).to(DEVICE) if residual else None
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(torch.bfloat16).to(DEVICE)
    rows, res = fa.rms_norm_quantized(x, r, w, 1e-6, cast_first)
    if residual:
        normed, want_res = triton_rmsnorm.add_rms_norm(x, r, w, 1e-6, cast_first)
        assert torch.equal(res, want_res)
    else:
        normed = triton_rmsnorm.rms_norm(x, w, 1e-6, cast_first)
        assert res is None
    q, s = tg.quantize_activation(normed, pad_rows_to=fa.PAD_ROWS)
    assert rows.m == m and rows.q.shape == q.shape
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rows.scale, s)


@pytest.mark.parametrize("kernel,splits,e4m3", [(k, s, e) for k, s in [("decode", 1), ("decode", 3), ("prefill", None)]
                                                for e in (False, True)] + [("wide", None, False), ("tma", None, False)])
def test_attention_quantized_output_equals_the_output_then_the_quantize(kernel, splits, e4m3):
    """The attention kernels' output rows (head_dim 128: one 128-wide group a head) quantized in their
    epilogue (the merge kernel's with splits) give the bits of the output then ``quantize_activation``,
    over a bf16 and an e4m3 KV pool (the prefill kernel's wide and TMA variants: bf16 only)."""
    from megatron_async.kernels import kv_cache_fp8 as kf
    from megatron_async.kernels.triton_decode_attention import decode_attention
    from megatron_async.kernels.triton_kv_append import append_kv
    from megatron_async.kernels.triton_prefill_attention import PrefillLaunch, prefill_attention
    from tests.helpers.paged_attention_cases import make_case

    rows = [(0, 1), (3, 1), (7, 1), (16, 1), (21, 1)] if kernel == "decode" else [(0, 7), (9, 6), (5, 1), (3, 12)]
    case = make_case(rows, num_heads=4, num_kv_heads=2, head_dim=128, block_size=4, device=DEVICE, seed=len(rows),
                     dtype=torch.bfloat16)
    pool, scales = case.kv_cache, None
    if e4m3:
        scales = torch.tensor([[1.0, 0.5], [0.25, 1.0]], device=DEVICE)
        pool = torch.nan_to_num(case.kv_cache.float(), nan=0.0).to(kf.FP8_KV)
    append_kv(pool, case.k, case.v, case.meta.slot_mapping, scales)
    if kernel == "decode":
        run = lambda quantize: decode_attention(case.q, pool, case.meta, case.scale, num_splits=splits,  # noqa: E731
                                                kv_scale=scales, quantize=quantize)
    else:
        launch = None if kernel == "prefill" else PrefillLaunch(16, 4, 4, 2, 0, kernel)
        run = lambda quantize: prefill_attention(case.q, pool, case.meta, case.scale, kv_scale=scales,  # noqa: E731
                                                 quantize=quantize, launch=launch)
    out, got = run(False), run(True)
    q, s = tg.quantize_activation(out.reshape(out.shape[0], -1), pad_rows_to=fa.PAD_ROWS)
    m = out.shape[0]
    assert isinstance(got, fa.QuantizedRows) and got.m == m and got.q.shape == q.shape
    assert torch.equal(got.q[:m].view(torch.uint8), q[:m].view(torch.uint8)) and torch.equal(got.scale[:m], s[:m])


def test_fp8_linear_over_quantized_rows_equals_it_over_the_activation():
    m, inter, n = 40, 256, 96  # above SMALL_M rows: the GEMM reads pre-quantized rows
    gate_up = _gate_up(m, inter, seed=3)
    w, ws = fq.quantize_weight(torch.randn(n, inter, generator=torch.Generator().manual_seed(4)) * 0.05)
    w, ws = w.to(DEVICE), ws.to(DEVICE)
    act = triton_act.silu_and_mul(gate_up)
    want = tg.fp8_linear(act, w, ws)
    got = tg.fp8_linear(fa.silu_and_mul_quantized(gate_up), w, ws)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert (want.float() - fq.fp8_linear_reference(act, w, ws).float()).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.skipif(DEVICE != "cuda", reason="the one-kernel path is a CUDA path")
@pytest.mark.parametrize("rows", [1, 8, 64, 128, 300])
def test_swiglu_mlp_hands_the_down_projection_quantized_rows_where_it_would_quantize(rows, monkeypatch):
    from megatron_async.models.layers.block import StepInputs
    from megatron_async.kernels.backends import KernelBackends
    from megatron_async.models.layers.mlp import SwiGLUMLP
    from megatron_async.models.quantization import Fp8Config, QuantScope
    from megatron_async.parallel.state import ParallelState

    torch.manual_seed(rows)
    mlp = SwiGLUMLP(512, 1024, False, ParallelState(), torch.bfloat16, "cuda",
                    QuantScope(Fp8Config(), "model.layers.0.mlp"))
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        q, s = fq.quantize_weight(torch.randn(lin.weight.shape, device="cuda") * 0.05)
        lin.weight.data.copy_(q)
        lin.weight_scale_inv.data.copy_(s)
    calls, real = [], fused_ops.silu_and_mul_quantized
    monkeypatch.setattr(fused_ops, "silu_and_mul_quantized", lambda t: calls.append(t.shape[0]) or real(t))
    x = torch.randn(rows, 512, device="cuda").to(torch.bfloat16)
    step = StepInputs(SimpleNamespace(batch_invariant=False, lora_slots=None, lora_rows=None), None, None,
                      kernels=KernelBackends(attention="triton", fused=True))
    got = mlp(x, step)
    expect_fused = tg.fp8_linear_prequantizes(rows, x.dtype, x.device, mlp.down_proj.weight,
                                              mlp.down_proj.weight_scale_inv, 128)
    assert calls == ([rows] if expect_fused else []), (calls, expect_fused)
    want = mlp.down_proj(triton_act.silu_and_mul(mlp.gate_up_proj(x)))
    assert torch.equal(got, want)


def test_mlps_name_the_fp8_linear_that_alone_reads_their_input():
    from megatron_async.models.layers.mlp import ReluSquaredMLP, SwiGLUMLP
    from megatron_async.models.quantization import Fp8Config, QuantScope
    from megatron_async.parallel.state import ParallelState

    fp8 = QuantScope(Fp8Config(), "model.layers.0.mlp")
    for cls, first in ((SwiGLUMLP, "gate_up_proj"), (ReluSquaredMLP, "up_proj")):
        assert cls(256, 512, False, ParallelState(), torch.bfloat16, "cpu").fp8_input_linear is None
        mlp = cls(256, 512, False, ParallelState(), torch.bfloat16, "cpu", fp8)
        assert mlp.fp8_input_linear is getattr(mlp, first)


def test_a_linear_decides_once_per_row_count_whether_it_quantizes_its_rows(monkeypatch):
    """``ParallelLinear.quantizes_rows_itself`` asks the FP8 GEMM's dispatch once per (rows, dtype,
    device) and answers from what it kept after; a bf16 weight answers False without asking."""
    from megatron_async.models.layers.mlp import SwiGLUMLP
    from megatron_async.models.quantization import Fp8Config, QuantScope
    from megatron_async.parallel.state import ParallelState

    asked = []
    monkeypatch.setattr(tg, "fp8_linear_prequantizes", lambda m, *a: asked.append(m) or m > 16)
    cuda = torch.device("cuda")  # the dispatch is replaced: nothing touches a device
    down = SwiGLUMLP(256, 512, False, ParallelState(), torch.bfloat16, "cpu",
                     QuantScope(Fp8Config(), "model.layers.0.mlp")).down_proj
    answers = [down.quantizes_rows_itself(m, torch.bfloat16, cuda) for m in (8, 64, 8, 64, 64)]
    assert answers == [False, True, False, True, True] and asked == [8, 64]
    assert fused_ops.fp8_input_prequantized(64, torch.bfloat16, cuda, down) == fused_ops.triton_importable()
    assert not fused_ops.fp8_input_prequantized(64, torch.bfloat16, torch.device("cpu"), down)
    plain = SwiGLUMLP(256, 512, False, ParallelState(), torch.bfloat16, "cpu").down_proj
    assert not plain.quantizes_rows_itself(64, torch.bfloat16, cuda) and asked == [8, 64]


@pytest.mark.skipif(DEVICE != "cuda", reason="the one-kernel path is a CUDA path")
@pytest.mark.parametrize("rows", [1, 8, 64, 128, 300])
@pytest.mark.parametrize("mlp_class", ["SwiGLUMLP", "ReluSquaredMLP"])
def test_a_blocks_norm_hands_its_fp8_mixer_quantized_rows_where_it_would_quantize(rows, mlp_class, monkeypatch):
    """A Block of RMSNorm + an FP8 MLP (its first projection alone reads the input): the norm's
    quantizing kernel runs exactly where that projection would quantize in a pass of its own, with
    the bits of the unfused block, from the embeddings (no residual) and with one."""
    from megatron_async.kernels.backends import KernelBackends
    from megatron_async.models.layers import mlp as mlps
    from megatron_async.models.layers.block import Block, StepInputs
    from megatron_async.models.layers.norm import RMSNorm
    from megatron_async.models.quantization import Fp8Config, QuantScope
    from megatron_async.parallel.state import ParallelState

    torch.manual_seed(rows + 1)
    mlp = getattr(mlps, mlp_class)(512, 1024, False, ParallelState(), torch.bfloat16, "cuda",
                                   QuantScope(Fp8Config(), "model.layers.0.mlp"))
    for lin in (mlp.fp8_input_linear, mlp.down_proj):
        q, s = fq.quantize_weight(torch.randn(lin.weight.shape, device="cuda") * 0.05)
        lin.weight.data.copy_(q)
        lin.weight_scale_inv.data.copy_(s)
    block = Block(RMSNorm(512, 1e-6, torch.bfloat16, "cuda"), mlp)
    calls, real = [], fused_ops.rms_norm_quantized
    monkeypatch.setattr(fused_ops, "rms_norm_quantized", lambda *a: calls.append(a[1] is None) or real(*a))
    step = StepInputs(SimpleNamespace(batch_invariant=False, lora_slots=None, lora_rows=None), None, None,
                      kernels=KernelBackends(attention="triton", fused=True))
    x = torch.randn(rows, 512, device="cuda").to(torch.bfloat16)
    res = torch.randn(rows, 512, device="cuda").to(torch.bfloat16)
    first, _ = block(x, None, step)
    later, summed = block(x, res, step)
    expect = tg.fp8_linear_prequantizes(rows, torch.bfloat16, x.device, mlp.fp8_input_linear.weight,
                                        mlp.fp8_input_linear.weight_scale_inv, 128)
    assert calls == ([True, False] if expect else []), (calls, expect)
    assert torch.equal(first, mlp(block.norm(x), step))
    assert torch.equal(summed, x + res) and torch.equal(later, mlp(block.norm(x + res), step))
