"""The FP8 quantization rules (fp8_quant) and the W8A8 block-scaled Triton GEMM against the float32
reference of the same block math (interpreter on CPU, compiled on CUDA): bits of the quantizers,
GEMM outputs within the rounding of the output dtype on odd shapes (M 1 / 7 / 129, K not a
multiple of 128), split-K, bias, row scales, and rows that do not depend on the batch."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from megatron_async.kernels import fp8_quant as fq, triton_fp8_gemm as tg  # noqa: E402
from megatron_async.kernels.triton_fp8_common import emulate, to_e4m3  # noqa: E402
from tests.helpers.fp8_checks import check_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 256, 256), (7, 128, 384), (129, 192, 200), (7, 576, 576), (1, 96, 130)]


@triton.jit
def _round_kernel(x_ptr, q_ptr, N: tl.constexpr, EMULATE: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(q_ptr + o, to_e4m3(tl.load(x_ptr + o), EMULATE))


def test_e4m3_rounding_matches_torch_on_every_midpoint():
    allv = torch.arange(256, dtype=torch.uint8).view(fq.FP8).float()
    pos = allv[(allv > 0) & ~allv.isnan()].sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([mids, -mids, pos, torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 100,
                   torch.tensor([460.0, 500.0, -1e4, 1e-6, -1e-6, -0.0, 0.0, -2.0 ** -11])])
    n = triton.next_power_of_2(x.numel())
    xx = torch.zeros(n)
    xx[: x.numel()] = x
    xx, q = xx.to(DEVICE), torch.empty(n, dtype=fq.FP8, device=DEVICE)
    _round_kernel[(1,)](xx, q, n, emulate(_round_kernel))
    assert torch.equal(q[: x.numel()].view(torch.uint8).cpu(), fq.to_e4m3(x).view(torch.uint8))


def test_scales_are_correctly_rounded_divisions():
    """amax / 448 and 448 / amax each rounded once (a reciprocal-then-multiply differs)."""
    amax = torch.rand(100000, generator=torch.Generator().manual_seed(2)) * 1000 + 1e-3
    s, inv = fq.group_scales(amax)
    assert torch.equal(s, (amax.double() / 448).float()) and torch.equal(inv, (448 / amax.double()).float())


def test_weight_blocks_follow_the_published_rule():
    """A straightforward loop over 128 x 128 blocks: s = amax / 448 (1 for a zero block), q = RNE(w / s)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=g) * torch.linspace(0.01, 5, 200)
    w[128:256, 128:] = 0.0
    q, s = fq.quantize_weight(w)
    assert q.dtype == fq.FP8 and s.shape == (3, 2) and s[1, 1] == 1.0
    for i in range(3):
        for j in range(2):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = blk.abs().max()
            assert s[i, j] == (amax / 448 if amax > 0 else 1.0)
            assert torch.equal(q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].view(torch.uint8),
                               (blk / s[i, j]).to(fq.FP8).view(torch.uint8))
    deq = fq.dequantize_weight(q, s)
    assert bool(((deq - w).abs() <= 2.0 ** -4 * fq.expand_block_scale(s, 300, 200) * 448 + 1e-12).all())


@pytest.mark.parametrize("m,k", [(1, 128), (7, 200), (33, 576)])
def test_activation_quant_kernel_matches_reference(m, k):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    x[0, :5] = 0.0
    q, s = tg.quantize_activation(x.to(DEVICE), pad_rows_to=4)
    rq, rs = fq.quantize_activation(x)
    assert q.shape[0] == -(-m // 4) * 4 and s.stride() == (1, q.shape[0])
    assert torch.equal(q[:m].view(torch.uint8).cpu(), rq.view(torch.uint8)) and torch.equal(s[:m].cpu(), rs)
    assert bool((q[m:].float() == 0).all())


def _weight(n, k, g):
    w = torch.randn(n, k, generator=g) * 0.05
    w[: min(n, 128), :128] *= 40  # blocks of very different ranges
    return fq.quantize_weight(w)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gemm_against_reference(m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    q, s = _weight(n, k, g)
    x = (torch.randn(m, k, generator=g) * torch.linspace(0.01, 30, k)).to(dtype)
    out = tg.fp8_linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE))
    assert out.dtype == dtype and out.shape == (m, n)
    check_gemm(out, x, q, s, ulps=1.0 if DEVICE == "cpu" else 0.5,
               slack=2.0 ** -20 if DEVICE == "cpu" else 2.0 ** -11)


@pytest.mark.parametrize("m,n,k", SHAPES[:3])
def test_prequantized_gemm_equals_fused(m, n, k):
    g = torch.Generator().manual_seed(7 + m)
    q, s = (t.to(DEVICE) for t in fq.quantize_weight(torch.randn(n, k, generator=g)))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    tiles, _ = tg.fp8_tiles(m, n, k, x.device)
    pre = tg.fp8_linear(x, q, s, tiles=tiles, prequantize=True)
    assert torch.equal(pre, tg.fp8_linear(x, q, s, tiles=tiles, prequantize=False))


def test_bias_split_k_and_row_scales():
    g = torch.Generator().manual_seed(3)
    n, k = 192, 520
    q, s = (t.to(DEVICE) for t in fq.quantize_weight(torch.randn(n, k, generator=g)))
    x = torch.randn(9, k, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE)
    for split in (1, 3):
        out = tg.fp8_linear(x, q, s, bias, tiles=tg.Fp8Tiles(16, 32, split, 1, 1))
        check_gemm(out, x, q, s, bias=bias, slack=2.0 ** -20 if DEVICE == "cpu" else 2.0 ** -11)
    # one scale row per weight row (SCALE_BLOCK_N = 1) gives the same bits as the 128-row grid
    assert torch.equal(tg.fp8_linear(x, q, fq.row_scales(s, n), bias, scale_block_n=1), tg.fp8_linear(x, q, s, bias))


@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (3, 96, 130), (2, 320, 320)])
def test_gemv_against_reference(m, n, k):
    """The CUDA-core kernel (block_m 1) at several launch settings: within the reference's bound,
    the same bits from pre-quantized activations, with row scales, and for each row alone."""
    g = torch.Generator().manual_seed(11 + m + n)
    q, s = (t.to(DEVICE) for t in _weight(n, k, g))
    x = (torch.randn(m, k, generator=g) * torch.linspace(0.01, 30, k)).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE)
    for tiles in (tg.Fp8Tiles(1, 16, 1, 1, 1, 1), tg.Fp8Tiles(1, 32, 1, 2, 2, 4)):
        out = tg.fp8_linear(x, q, s, bias, tiles=tiles, prequantize=False)
        check_gemm(out, x, q, s, bias=bias, ulps=1.0, slack=2.0 ** -20)
        assert torch.equal(tg.fp8_linear(x, q, s, bias, tiles=tiles, prequantize=True), out)
        assert torch.equal(tg.fp8_linear(x, q, fq.row_scales(s, n), bias, scale_block_n=1, tiles=tiles), out)
        for r in range(m):
            assert torch.equal(tg.fp8_linear(x[r:r + 1], q, s, bias, tiles=tiles), out[r:r + 1])


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(5)
    q, s = (t.to(DEVICE) for t in fq.quantize_weight(torch.randn(256, 384, generator=g)))
    x = torch.randn(129, 384, generator=g).to(torch.bfloat16).to(DEVICE)
    full = tg.fp8_linear(x, q, s, batch_invariant=True)
    for rows in (slice(0, 1), slice(3, 10), slice(128, 129)):
        assert torch.equal(tg.fp8_linear(x[rows], q, s, batch_invariant=True), full[rows])
    perm = torch.randperm(129, generator=g).to(DEVICE)
    assert torch.equal(tg.fp8_linear(x[perm], q, s, batch_invariant=True), full[perm])


def test_bad_operands_are_refused():
    q, s = fq.quantize_weight(torch.randn(64, 130))
    with pytest.raises(ValueError, match="grid"):
        tg.fp8_linear(torch.randn(2, 130), q, s[:, :1])
    with pytest.raises(ValueError, match="does not fit"):
        tg.fp8_linear(torch.randn(2, 128), q, s)
