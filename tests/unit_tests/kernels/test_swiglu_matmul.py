"""The fused gate_up projection + SwiGLU kernel against ``F.linear`` then ``silu(gate) * up``, and
its relu^2 form (NemotronH's up) against ``F.linear`` then ``relu(h)^2``: in Triton's interpreter on
CPU (tiny tiles crossing M, I and K edges), compiled at the real shapes on a Hopper GPU, under
CUDA-graph capture, and routed through by the MLP layers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from megatron_async.kernels import fused_ops, triton_swiglu_matmul  # noqa: E402
from megatron_async.kernels.triton_swiglu_matmul import relu2_linear, supported, swiglu_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    gate, up = F.linear(x, w, b).split(w.shape[0] // 2, dim=-1)
    return F.silu(gate) * up


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    else:  # projections rounded after another accumulation order, then silu and the product
        torch.testing.assert_close(out, ref, rtol=3e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter shapes; the GPU test below takes the real ones")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,inter,k,bias", [(5, 48, 40, False), (33, 24, 24, True), (1, 16, 8, False),
                                            (17, 40, 72, True)])
def test_matches_linear_then_swiglu(dtype, m, inter, k, bias):
    # interpreter tiles are 16 x 16 x 16: I = 24 / 40 leave a partial last column tile whose
    # gate half reads up rows (clipped by the store), K = 40 / 72 a partial last K step
    torch.manual_seed(m * inter + k)
    x = torch.randn(m, k, dtype=dtype)
    w = 0.2 * torch.randn(2 * inter, k, dtype=dtype)
    b = torch.randn(2 * inter, dtype=dtype) if bias else None
    _assert_close(swiglu_linear(x, w, b), _reference(x, w, b))


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter shapes; the GPU test below takes the real ones")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,inter,k,bias", [(5, 48, 40, False), (33, 24, 24, True), (17, 40, 72, True)])
def test_relu2_matches_linear_then_relu_square(dtype, m, inter, k, bias):
    torch.manual_seed(m * inter + k + 1)
    x = torch.randn(m, k, dtype=dtype)
    w = 0.2 * torch.randn(inter, k, dtype=dtype)
    b = torch.randn(inter, dtype=dtype) if bias else None
    _assert_close(relu2_linear(x, w, b), torch.relu(F.linear(x, w, b)).square())


def test_supported_rejects_what_the_descriptors_cannot_take():
    w = torch.randn(32, 16)
    assert supported(torch.randn(4, 16), w)
    assert not supported(torch.randn(4, 18)[:, :16], w)  # row stride of 72 bytes
    assert not supported(torch.randn(4, 16).half(), w)  # dtypes differ
    assert not supported(torch.randn(4, 16), torch.randn(31, 16))  # odd 2I
    assert not supported(torch.randn(4, 16), torch.randn(6, 16))  # I = 3 floats: 12-byte output rows
    assert supported(torch.randn(4, 16), torch.randn(4, 16), gated=False)  # relu^2: I = 4 floats
    assert not supported(torch.randn(4, 16), torch.randn(6, 16), gated=False)  # 24-byte output rows
    assert not supported(torch.randn(4, 16).t(), torch.randn(32, 4))  # K not unit-stride
    assert not supported(torch.randn(2, 4, 16), w)
    with pytest.raises(ValueError, match="unsupported operands"):
        swiglu_linear(torch.randn(4, 18)[:, :16], w)
    with pytest.raises(ValueError, match="bias"):
        swiglu_linear(torch.randn(4, 16), w, torch.randn(31))


def test_empty_rows():
    out = swiglu_linear(torch.randn(0, 16, device=DEVICE), torch.randn(32, 16, device=DEVICE))
    assert out.shape == (0, 16)


def test_row_buckets_follow_the_measured_crossover():
    assert triton_swiglu_matmul.pays_off(1, 1024) and triton_swiglu_matmul.pays_off(128, 1024)
    assert not triton_swiglu_matmul.pays_off(512, 1024) and triton_swiglu_matmul.pays_off(8192, 1024)
    assert not triton_swiglu_matmul.pays_off(8192, 4096)  # the round trip it saves is too small there
    assert all(triton_swiglu_matmul.pays_off(m, 1024, gated=False) for m in (1, 128, 512, 8192))
    assert not triton_swiglu_matmul.pays_off(128, 4096, gated=False)


@pytest.mark.parametrize("gated", [True, False])
def test_mlp_routes_through_the_fused_kernel(monkeypatch, gated):
    """The SwiGLU MLP (``gated``) and NemotronH's relu^2 MLP take the kernel when their model's kernels
    are fused, the unfused kernels otherwise, with the same result; a row count the kernel does not
    pay off at stays unfused."""
    from types import SimpleNamespace

    from megatron_async.kernels.backends import KernelBackends
    from megatron_async.models.layers.block import StepInputs
    from megatron_async.models.layers.mlp import ReluSquaredMLP, SwiGLUMLP
    from megatron_async.parallel.state import ParallelState

    torch.manual_seed(0)
    mlp = (SwiGLUMLP if gated else ReluSquaredMLP)(32, 48, False, ParallelState(), torch.float32, DEVICE)
    for p in mlp.parameters():
        p.data.normal_(0, 0.2)
    calls = []
    real = triton_swiglu_matmul._launch
    monkeypatch.setattr(triton_swiglu_matmul, "_launch", lambda *a: calls.append((a[0].shape[0], a[4])) or real(*a))
    monkeypatch.setattr(fused_ops, "use_fused", lambda x, enabled=True: enabled)  # also on CPU
    x = torch.randn(9, 32, device=DEVICE)
    fused = mlp(x)
    assert calls == [(9, gated)]
    monkeypatch.setattr(triton_swiglu_matmul, "pays_off", lambda *a: False)
    unfused = mlp(x)
    assert calls == [(9, gated)]
    unfused_model = StepInputs(SimpleNamespace(batch_invariant=False, lora_slots=None, lora_rows=None), None, None,
                               kernels=KernelBackends(fused=False))
    reference = mlp(x, unfused_model)  # the layer's torch code
    assert calls == [(9, gated)]
    _assert_close(fused, reference)
    _assert_close(unfused, reference)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (TMA) GPU")
@pytest.mark.parametrize("m", [1, 77, 128, 256, 2048, 8192])
def test_relu2_bits_equal_cublas_then_relu_square_on_gpu(m):
    """NemotronH's up (I 4,096, K 1,024), bf16: where both round the same float32 sums, the fused
    kernel's output is cuBLAS's then ``relu_square``'s; elsewhere within a bf16 rounding of it."""
    from megatron_async.kernels.triton_act import relu_square

    torch.manual_seed(m)
    x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
    w = 0.03 * torch.randn(4096, 1024, dtype=torch.bfloat16, device="cuda")
    ref = relu_square(F.linear(x, w))
    got = relu2_linear(x, w)
    _assert_close(got, ref)
    assert (got == ref).float().mean().item() > 0.9  # other sums' order: a few last bits differ
    x32, w32 = x.float(), w.float()  # float32 takes narrower tiles (shared memory)
    _assert_close(relu2_linear(x32, w32), torch.relu(F.linear(x32, w32)).square())


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (TMA) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 77, 128, 2048, 8192])
def test_real_shapes_on_gpu(dtype, m):
    torch.manual_seed(m)
    x = torch.randn(m, 1024, dtype=dtype, device="cuda")
    w = 0.03 * torch.randn(6144, 1024, dtype=dtype, device="cuda")
    _assert_close(swiglu_linear(x, w), _reference(x, w, None))
    b = torch.randn(6144, dtype=dtype, device="cuda")
    _assert_close(swiglu_linear(x, w, b), _reference(x, w, b))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (TMA) GPU")
@pytest.mark.parametrize("fn, rows, n", [(swiglu_linear, 96, 6144), (relu2_linear, 96, 4096),
                                         (relu2_linear, 4096, 4096)])
def test_graph_replay_matches_eager_on_gpu(fn, rows, n):
    from benchmarks.cuda_timing import capture

    torch.manual_seed(0)
    x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
    w = 0.03 * torch.randn(n, 1024, dtype=torch.bfloat16, device="cuda")
    graph, captured = capture(lambda: fn(x, w))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fn(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (TMA) GPU")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_ragged_rows_against_the_unfused_kernels_on_gpu(dtype, tol):
    """777 rows (no tile multiple) at the qwen3-0.6b MLP (I 3,072, K 1,024) against F.linear then
    the SiLU-mul kernel, the MLP's unfused path (fp32: exact operands, tf32 off): the largest
    |fused - ref| / (|ref| + 1e-2) under 1e-4 (fp32) / 2e-2 (bf16)."""
    from megatron_async.kernels.triton_act import silu_and_mul

    torch.manual_seed(0)
    w = (0.03 * torch.randn(6144, 1024, device="cuda", dtype=torch.bfloat16)).to(dtype)
    x = torch.randn(777, 1024, device="cuda", dtype=dtype)
    ref = silu_and_mul(F.linear(x, w)).float()
    assert ((swiglu_linear(x, w).float() - ref).abs() / (ref.abs() + 1e-2)).max().item() < tol
