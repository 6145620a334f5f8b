"""A row-parallel output projection at decode sizes, split along K, its sum left to the next norm.

At 1-128 rows an output projection (o_proj, down_proj, Mamba's out_proj: N = hidden) reads
2-16 MB of weights, and cuBLAS's kernel takes 5-10 us for 1-3 us of bytes: too few output
tiles to keep every SM reading (cuBLAS adds a split-K reduce kernel of its own to some).
Here each program multiplies one output tile over one K range and stores its float32 partial
product ([splits, M, N]); the next block's norm sums the partials in split order, adds the
bias, rounds to the activation dtype (where the GEMM's output would be rounded), then adds the
residual and normalises in one kernel (``PendingSplitSum.add_rms_norm``), so the split costs
no launch of its own. ``reduce`` is the same sum alone, for a consumer that is not such a norm.
The residual stream comes out as ``reduce()`` then ``add_rms_norm`` would give it, bit for bit;
the normalised rows may differ from that in a last bit, the norm's float32 sum of squares being
reduced by 8 warps a row (the plain norm kernel's 2-4 warps read the partials 0.2-0.5 us slower).

At one row (batch-1 decode) the CUDA-core GEMV (``triton_gemv``) writes the partials instead of
the tensor-core kernel, which computes 1 of its 16 tile rows there.

Deterministic: a fixed split and a fixed summation order for each shape. The bits differ from
cuBLAS's (another accumulation order), as any two GEMMs' do, and a row's bits at one row from
its bits in a larger batch (a 1-token row against a (k + 1)-token verify row, as docs/SPECULATIVE.md
allows); batch-invariant mode keeps its own matmul."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_async.kernels import cuda_device, launch_limits, triton_gemv
from megatron_async.kernels.deferred_sum import DeferredSum
from megatron_async.kernels.triton_paged_common import dot_args
from megatron_async.kernels.triton_rmsnorm import add_norm_row


@triton.jit(do_not_specialize=["M", "N", "k_per_split"])
def _split_gemm_kernel(a_desc, w_desc, part_ptr, M, N, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n, split = tl.program_id(0) // num_n, tl.program_id(0) % num_n, tl.program_id(1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, k0]).to(DOT_DTYPE)
        w = w_desc.load([pid_n * BLOCK_N, k0]).to(DOT_DTYPE)
        acc = tl.dot(a, w.T, acc, input_precision=DOT_PRECISION)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = split.to(tl.int64) * M + offs_m
    tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _sum_norm_kernel(part_ptr, bias_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, M, eps, SPLITS: tl.constexpr,
                     N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                     CAST_BEFORE_WEIGHT: tl.constexpr):
    # one program per row: the partials summed in split order, then as the GEMM's rounded output
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    s = tl.load(part_ptr + row * N + offs, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLITS):
        s += tl.load(part_ptr + (i * M + row) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        s += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x = s.to(res_out_ptr.dtype.element_ty)
        r = tl.load(res_ptr + row * N + offs, mask=mask, other=0.0)
        add_norm_row(x, r, w_ptr, out_ptr, res_out_ptr, row, offs, mask, eps, N, True, CAST_BEFORE_WEIGHT)
    else:
        tl.store(out_ptr + row * N + offs, s.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class SplitTiles:
    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int


SPLITS, BLOCK_K = 4, 128
SUM_WARPS = 8
"""Warps a row of the norm that sums the partials (its four partial rows in flight at once)."""


def split_tiles(m: int, n: int, k: int) -> SplitTiles | None:
    """The launch for an [m, k] x [n, k]^T product, or None where cuBLAS keeps it: a function of
    the shape only, so every replay of a graph takes its capture's path. Where it pays (one H100,
    the GEMM and the next norm against cuBLAS and the add + norm kernel, 1-256 rows, K 1,024-12,288,
    N 1,024-4,096, 32 launch settings each): N <= 1,024 up to 128 rows (0.6B / hybrid shapes, K >=
    2,048: 1.05-1.25x) and N <= 2,048 up to 64 rows (1.07-1.17x). At K = 1,024 there is nothing to
    split (0.99-1.06x), and wider outputs fill the device without a split (N = 4,096: 0.81-1.07x),
    but at one row, where the GEMV writes the partials, for any N (Qwen3-8B's o_proj / down_proj
    at batch 1 on an H200: 13.3 / 29.9 us on cuBLAS, 10.2 / 25.4 as the GEMV's partials)."""
    if k < 2048 or k % (SPLITS * BLOCK_K) or m < 1:
        return None
    if not (m == 1 or m <= 128 and n <= 1024 or m <= 64 and n <= 2048):
        return None
    return SplitTiles(64, 64, BLOCK_K, SPLITS, 4, 4)


ROW_PARALLEL_MAX_ROWS = 16
"""Decode batches up to this many rows split a TP rank's projections (``tp_rank_tiles``)."""


def tp_rank_tiles(m: int, n: int, k: int) -> SplitTiles | None:
    """The launch for a TP rank's projection at decode sizes whose partials a kernel that runs
    anyway sums (no launch of its own), or None where cuBLAS keeps it: a row-parallel output
    projection's, by the fused all-reduce + add + RMSNorm (``triton_fused_all_reduce``); the
    column-parallel qkv's, by the q/k norm + rope (``triton_rope``). A TP rank's output or
    reduction dimension is 1/TP of the model's (Qwen3-8B at TP=4: o_proj K = 1,024, down_proj
    3,072, N = 4,096; qkv N = 1,536, K = 4,096): cuBLAS runs these as a split-K GEMM plus a reduce
    kernel of its own, 7-10 us for 2-6 us of weight reads at batch 1 (4x H200). 16-row tiles (a
    decode batch of 1-16) and 64 output columns, four K splits: 256 programs for N = 4,096."""
    if not 1 <= m <= ROW_PARALLEL_MAX_ROWS or k % (SPLITS * BLOCK_K) or n % 64:
        return None
    return SplitTiles(16, 64, BLOCK_K, SPLITS, 4, 4)


def footprint(elem_bytes: int):
    """An A and a weight tile a step, one float32 accumulator stored as it is."""
    return lambda t: launch_limits.gemm_footprint(t.block_m, t.block_n, t.block_k, t.num_stages, t.num_warps,
                                                  elem_bytes, elem_bytes)


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles=split_tiles) -> bool:
    """Whether ``split_linear`` takes this product: an sm90 device (the tiles' measurements), 2-D
    bf16 / fp16 operands with unit last strides, 16-byte-aligned rows, a shape ``tiles`` (a
    tile choice: ``split_tiles`` or ``tp_rank_tiles``) splits."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1 and weight.is_contiguous()):
        return False
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return False
    if (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        return False
    if cuda_device.capability(x.device)[0] != 9:
        return False
    return tiles(x.shape[0], weight.shape[0], x.shape[1]) is not None


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tiles=split_tiles) -> PendingSplitSum:
    """``x @ weight.T + bias`` as float32 partials over K splits (``takes(..., tiles)`` must hold)."""
    (m, k), n = x.shape, weight.shape[0]
    t = tiles(m, n, k)
    assert t is not None
    if m == 1:
        return PendingSplitSum(triton_gemv.gemv_parts(x, weight, t.splits), bias, x.dtype)
    t = launch_limits.fit(t, footprint(x.element_size()), launch_limits.device_limits(x.device))
    parts = torch.empty(t.splits, m, n, dtype=torch.float32, device=x.device)
    a_desc = TensorDescriptor.from_tensor(x, [t.block_m, t.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [t.block_n, t.block_k])
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), t.splits)
    _split_gemm_kernel[grid](a_desc, w_desc, parts, m, n, k // t.splits, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                             BLOCK_K=t.block_k, **dot_args(_split_gemm_kernel, x.dtype), num_warps=t.num_warps,
                             num_stages=t.num_stages)
    return PendingSplitSum(parts, bias, x.dtype)


def _sum(parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, residual: torch.Tensor | None = None,
         weight: torch.Tensor | None = None, eps: float = 0.0, cast_before_weight: bool = True):
    splits, m, n = parts.shape
    out = torch.empty(m, n, dtype=dtype, device=parts.device)
    res_out = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(n)
    if m:
        _sum_norm_kernel[(m,)](parts, parts if bias is None else bias, out if residual is None else residual,
                               out if weight is None else weight, out, res_out, m, eps, SPLITS=splits, N=n,
                               BLOCK_N=block, HAS_BIAS=bias is not None, NORM=residual is not None,
                               CAST_BEFORE_WEIGHT=cast_before_weight, num_warps=SUM_WARPS)
    return out, res_out


@dataclass(frozen=True)
class PendingSplitSum(DeferredSum):
    """``split_linear``'s partials: summed by the next norm's kernel, or by ``reduce``."""

    parts: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    def reduce(self) -> torch.Tensor:
        return _sum(self.parts, self.bias, self.dtype)[0]

    def add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     cast_before_weight: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not (self.dtype == residual.dtype == weight.dtype and residual.is_contiguous()
                and residual.shape == self.parts.shape[1:]):
            return None
        return _sum(self.parts, self.bias, self.dtype, residual, weight, eps, cast_before_weight)
