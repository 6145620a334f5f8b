"""One row times a 16-bit weight on the CUDA cores, as float32 K-split partials: a batch-1 decode
step's projections (``triton_split_linear.split_linear`` at one row).

At one row a tensor-core tile computes 1 of its 16 rows and stages the weight through shared memory;
here each program reads ``block_n`` weight rows over one K split straight into registers (16-byte
loads along K), multiplies them by the row's values of that split (from L2) and sums along K in
float32. Every program streams its own weight bytes, so ~1,000 programs keep the device's memory
busy where a GEMM's ~100 output tiles could not. The partials [splits, 1, N] are what the
tensor-core split GEMM writes, summed by the same consumers (the next norm, the fused all-reduce,
the q/k norm + rope). Deterministic: the split, the tile and the summation order are functions of
the shape; the bits differ from the tensor-core kernel's (another summation order)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_parts_kernel(x_ptr, w_ptr, part_ptr, N, K, k_per_split, stride_wn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # k_per_split specialised (a multiple of 16 where the shapes are): the weight loads then
    # vectorise to 16 bytes; a K mask of unknown alignment kept them at 2 (1.5-1.8x slower)
    split = tl.program_id(1)
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:  # the split is whole BLOCK_K steps: no mask along K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptr + offs_k)
        else:
            k_mask = offs_k < k_hi
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(part_ptr + split.to(tl.int64) * N + offs_n, acc, mask=n_mask)


class GemvTiles(NamedTuple):
    block_n: int
    """Weight rows a program."""
    block_k: int
    num_warps: int


def gemv_tiles(n: int, k: int, splits: int) -> GemvTiles:
    """Launch settings for an [1, k] x [n, k]^T product in ``splits`` K splits: 8 weight rows a program
    on 4 warps, 512-wide steps where a split is whole 512-wide steps, else 256 (a split's tail step
    masked half empty cost Qwen3-8B's TP=4 o_proj 5.1 against 4.2 us). Within 6 % of the fastest of
    8 / 16 rows x 256 / 512 x 4 / 8 warps at Qwen3-0.6B's and Qwen3-8B's batch-1 projections, whole
    and as TP=2 / TP=4 shards (one H200, ``python -m benchmarks decode-gemms --gemv``)."""
    return GemvTiles(8, 512 if (k // splits) % 512 == 0 else 256, 4)


def gemv_parts(x: torch.Tensor, weight: torch.Tensor, splits: int, tiles: GemvTiles | None = None) -> torch.Tensor:
    """x [1, K] (unit stride along K), weight [N, K] contiguous -> float32 partials [splits, 1, N]: split s holds
    the products over K columns [s * K / splits, (s + 1) * K / splits) (K a multiple of ``splits``)."""
    (m, k), n = x.shape, weight.shape[0]
    if m != 1 or k % splits or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"gemv_parts takes one row, K a multiple of {splits} and a contiguous weight: "
                         f"x {tuple(x.shape)} stride {x.stride()}, weight {tuple(weight.shape)}")
    t = tiles or gemv_tiles(n, k, splits)
    parts = torch.empty(splits, 1, n, dtype=torch.float32, device=x.device)
    _gemv_parts_kernel[(triton.cdiv(n, t.block_n), splits)](x, weight, parts, n, k, k // splits, weight.stride(0),
                                                            BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                                            EVEN_K=(k // splits) % t.block_k == 0,
                                                            num_warps=t.num_warps)
    return parts
