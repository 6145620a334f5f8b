"""The CUDA-core GEMV's K-split partials (``triton_gemv``): each split's partial equals the product
over its K range within float32 summation error (interpreted on CPU at tiles crossing N and a split
end that is not a whole tile, compiled at Qwen3-8B's batch-1 shapes on a GPU, in a CUDA graph), the
same bits every call, and a clear error for what it does not take."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels.triton_gemv import GemvTiles, gemv_parts, gemv_tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    k = x.shape[1] // splits
    return torch.stack([x[:, i * k:(i + 1) * k].double() @ w[:, i * k:(i + 1) * k].double().T for i in range(splits)])


def _check(n: int, k: int, splits: int, dtype: torch.dtype, tiles: GemvTiles | None, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    parts = gemv_parts(x, w, splits, tiles)
    assert parts.shape == (splits, 1, n) and parts.dtype == torch.float32
    want = _reference(x, w, splits)
    torch.testing.assert_close(parts.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    return parts


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter shapes; the GPU test takes the real ones")
@pytest.mark.parametrize("n,k,splits,block_k", [(37, 512, 4, 64), (64, 600, 4, 64), (20, 96, 1, 64), (100, 384, 2, 128)])
def test_partials_interpreted(n, k, splits, block_k):
    # 16-row tiles: N = 37 / 100 end in a partial tile; K / splits = 150 / 192 cross a 64- or 128-wide step mid-tile
    _check(n, k, splits, torch.bfloat16, GemvTiles(16, block_k, 4), seed=n + k)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels")
@pytest.mark.parametrize("n,k", [(1536, 4096), (4096, 1024), (4096, 3072), (4096, 4096), (4096, 12288), (1024, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_shapes_on_the_gpu(n, k, dtype):
    parts = _check(n, k, 4, dtype, None, seed=n * k)
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    assert torch.equal(gemv_parts(x, w, 4), parts)  # the same bits every call
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv_parts(x, w, 4)
    x.copy_(-x)
    graph.replay()
    assert torch.equal(captured, gemv_parts(x, w, 4))
    assert (k // 4) % gemv_tiles(n, k, 4).block_k == 0  # whole steps a split: the unmasked loads


def test_refuses_what_it_does_not_take():
    w = torch.zeros(8, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one row"):
        gemv_parts(torch.zeros(2, 64, device=DEVICE, dtype=torch.bfloat16), w, 4)
    with pytest.raises(ValueError, match="multiple of 3"):
        gemv_parts(torch.zeros(1, 64, device=DEVICE, dtype=torch.bfloat16), w, 3)
