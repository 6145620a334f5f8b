"""The K-split output projection whose sum the next norm takes (``triton_split_linear``): its
partials sum to ``F.linear`` within the dtype's rounding (interpreted on CPU at tiles crossing
the M and N edges, compiled at real shapes on a Hopper GPU, under CUDA-graph capture); the
norm's one kernel gives the residual stream of ``reduce()`` then ``add_rms_norm`` bit for bit
and its normalised rows within a last-bit step, in both norm orders; a
row-parallel output projection hands it to its norm exactly where the tiles take the shape, and
a model without the fused kernels or with ``split_linear`` off does not get it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from megatron_async.kernels import fused_ops, triton_rmsnorm  # noqa: E402
from megatron_async.kernels import triton_split_linear as sl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _operands(m: int, n: int, k: int, bias: bool, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE)


def _check_sum(pending: sl.PendingSplitSum, x, w, b) -> torch.Tensor:
    out = pending.reduce()
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == x.dtype and out.shape == ref.shape
    # one rounding of a float32 sum: within an ulp of the exact product, as cuBLAS's output is
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    return out


def _check_norm_bits(pending: sl.PendingSplitSum, seed: int) -> None:
    m, n = pending.parts.shape[1:]
    g = torch.Generator().manual_seed(seed)
    residual = torch.randn(m, n, generator=g).to(pending.dtype).to(DEVICE)
    weight = (torch.rand(n, generator=g) + 0.5).to(pending.dtype).to(DEVICE)
    for cast_before_weight in (True, False):
        got = pending.add_rms_norm(residual, weight, 1e-6, cast_before_weight)
        want = triton_rmsnorm.add_rms_norm(pending.reduce(), residual, weight, 1e-6, cast_before_weight)
        assert torch.equal(got[1], want[1])  # the residual stream: the same roundings, elementwise
        # the norm's float32 sum of squares may be reduced in another order (8 warps a row, not
        # the plain norm's 2-4): at most a last-bit step of the normalised row, then of the product
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2**-7, atol=0.0)
    # a float32 residual stream (Mamba2's residual_in_fp32) is left to reduce() and the plain norm
    assert pending.add_rms_norm(residual.float(), weight, 1e-6, True) is None


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter shapes; the GPU test below takes the real ones")
@pytest.mark.parametrize("m,n,k,bias", [(5, 96, 2048, False), (70, 40, 2048, True), (1, 64, 2560, True)])
def test_partials_sum_to_the_product_interpreted(m, n, k, bias):
    # 64 x 64 tiles: 70 rows cross a row tile, N = 40 / 96 a partial column tile; K = 2,560 five 128-deep steps a
    # split; one row: the GEMV's partials
    x, w, b = _operands(m, n, k, bias, seed=m + n)
    pending = sl.split_linear(x, w, b)
    assert pending.parts.shape == (sl.SPLITS, m, n) and pending.parts.dtype == torch.float32
    _check_sum(pending, x, w, b)
    _check_norm_bits(pending, seed=m)


def test_tiles_split_only_where_they_paid():
    assert sl.split_tiles(128, 1024, 2048) is not None and sl.split_tiles(64, 2048, 4096) is not None
    assert sl.split_tiles(1, 1024, 3072) is not None
    assert sl.split_tiles(1, 4096, 4096) is not None and sl.split_tiles(1, 4096, 12288) is not None  # the GEMV's
    assert sl.split_tiles(129, 1024, 2048) is None  # the output tiles fill the device
    assert sl.split_tiles(128, 2048, 4096) is None and sl.split_tiles(16, 4096, 4096) is None
    assert sl.split_tiles(128, 1024, 1024) is None  # nothing to split
    assert sl.split_tiles(128, 1024, 2176) is None  # K not a whole number of 128-deep steps a split
    assert sl.split_tiles(0, 1024, 2048) is None


def test_takes_no_cpu_tensor_and_no_misfit():
    x, w = (t.cpu() for t in _operands(8, 64, 2048, False, seed=1)[:2])
    assert not sl.takes(x, w, None)
    assert fused_ops.split_linear(x, w, None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the split tiles are taken on Hopper only")
@pytest.mark.parametrize("m", [1, 16, 64, 100, 128])
@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072), (1024, 4096), (2048, 4096), (4096, 12288)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_shapes_on_the_gpu(m, n, k, dtype):
    x, w, b = _operands(m, n, k, bias=m == 100, seed=m * n + k, dtype=dtype)
    if sl.split_tiles(m, n, k) is None:
        assert not sl.takes(x, w, b)
        return
    assert sl.takes(x, w, b)
    assert not sl.takes(x[:, 1:], w[:, 1:], b)  # rows 2 bytes off the 16-byte grid
    pending = sl.split_linear(x, w, b)
    out = _check_sum(pending, x, w, b)
    _check_norm_bits(pending, seed=m)
    assert torch.equal(sl.split_linear(x, w, b).reduce(), out)  # the same bits every call
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sl.split_linear(x, w, b).reduce()
    x.copy_(x.flip(0))
    graph.replay()
    assert torch.equal(captured, sl.split_linear(x, w, b).reduce())


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the split tiles are taken on Hopper only")
def test_output_projection_defers_exactly_where_the_tiles_take_it():
    from megatron_async.models.layers.norm import RMSNorm
    from megatron_async.parallel.linear import RowParallelLinear
    from megatron_async.parallel.state import ParallelState

    proj = RowParallelLinear(3072, 1024, False, ParallelState(), torch.bfloat16, "cuda")
    torch.nn.init.normal_(proj.weight, std=0.02)
    norm = RMSNorm(1024, 1e-6, torch.bfloat16, "cuda")
    x, residual = torch.randn(128, 3072, device="cuda", dtype=torch.bfloat16), torch.randn(128, 1024, device="cuda",
                                                                                            dtype=torch.bfloat16)
    assert isinstance(proj(x), torch.Tensor)  # not a block's output projection: nothing deferred
    proj.defer_reduction = True
    pending = proj(x)
    assert isinstance(pending, sl.PendingSplitSum)
    got = norm.add_and_norm(pending, residual)
    want = norm.add_and_norm(pending.reduce(), residual)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2**-7, atol=0.0)
    assert isinstance(proj(torch.randn(512, 3072, device="cuda", dtype=torch.bfloat16)), torch.Tensor)
    assert isinstance(proj(x, batch_invariant=True), torch.Tensor)
    assert isinstance(proj(x, split_k=False), torch.Tensor)  # KernelBackends(fused=False) or split_linear=False


def test_tp_rank_tiles_split_a_tp_ranks_decode_projections():
    """Qwen3-8B at TP=4 / TP=2 (o_proj K = 1,024 / 2,048, down_proj 3,072 / 6,144, N = 4,096):
    split at 1-16 rows; larger batches, K off the split grid and ragged N stay with cuBLAS."""
    for k in (1024, 2048, 3072, 6144):
        for m in (1, 7, 16):
            t = sl.tp_rank_tiles(m, 4096, k)
            assert t is not None and t.block_m == 16 and (k // t.splits) % t.block_k == 0
        assert sl.tp_rank_tiles(17, 4096, k) is None
    assert sl.tp_rank_tiles(1, 4096, 1000) is None
    assert sl.tp_rank_tiles(1, 4100, 1024) is None
    assert sl.tp_rank_tiles(0, 4096, 1024) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the split tiles are taken on Hopper only")
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("k", [1024, 3072])
def test_tp_rank_tiles_on_the_gpu(m, k):
    x, w, _ = _operands(m, 4096, k, bias=False, seed=m + k)
    tiles = sl.tp_rank_tiles
    assert sl.takes(x, w, None, tiles) and fused_ops.split_linear(x, w, None, tp_rank=True) is not None
    pending = sl.split_linear(x, w, None, tiles)
    assert pending.parts.shape == (sl.SPLITS, m, 4096)
    out = _check_sum(pending, x, w, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sl.split_linear(x, w, None, tiles).reduce()
    graph.replay()
    assert torch.equal(captured, out)
