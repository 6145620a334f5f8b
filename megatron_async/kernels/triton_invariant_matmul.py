"""Batch-invariant linear layer: ``x @ weight.T + bias`` whose every output row is computed
the same way whatever the number of rows.

cuBLAS picks its algorithm (tile shape, split-K, stream-K) from M, the number of rows, so
the bits of one row change with the batch around it. Here the tile shape depends only on
the weight's shape (N, K) and the device, never on M; every output tile walks K from 0 to
K in BLOCK_K steps, accumulating in float32 in that one order (no split-K); the bias is
added in float32 and the sum rounded once. A row's result is then a function of that row
and the weight only: equal bits at batch 1, 7 or 8192, in eager mode or a CUDA graph.

M is excluded from Triton's integer specialisation so that one compiled kernel serves
every row count. Runs on CPU under ``TRITON_INTERPRET=1`` (tests)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_paged_common import dot_args


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Grouped tile order (GROUP_M row tiles share a column of weight tiles in L2). The
    # order only schedules tiles: each tile's arithmetic is the same wherever it runs.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m[:, None] * stride_am
    w_cols = w_ptr + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        # Out-of-range rows / k load 0: they add exact zeros to the real rows' sums.
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tile_config(n: int, k: int, device: torch.device) -> TileConfig:
    """Tiles for an [N, K] weight. A function of (N, K, device) ONLY: the invariance of
    the whole mode rests on M never reaching this choice.

    GPU: 64-row tiles (a decode batch of ~128 fills two), 128 columns for wide weights
    (QKV, gate_up, LM head) and 64 for narrow ones (o_proj, down_proj), so small-M steps
    still spread over the SMs. CPU (interpreter): tiles that tiny test shapes still cross
    in M, N and K, yet few programs (the interpreter pays per program)."""
    if device.type != "cuda":
        return TileConfig(32, 64, 32, 1, 1)
    block_n = 128 if n >= 4096 else 64
    return TileConfig(64, block_n, 64, 4, 4)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with row-count-independent numerics (see the module
    docstring). x: [..., K]; weight: [N, K]; bias: [N] or None. Returns [..., N] in x's dtype."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"invariant_linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype)):
        raise ValueError(f"invariant_linear: dtypes/shapes x {x.dtype}, weight {weight.dtype}, "
                         f"bias {None if bias is None else (tuple(bias.shape), bias.dtype)}")
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1])
    n, k = weight.shape
    m = a.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        return (out.zero_() if bias is None else out.copy_(bias.expand(m, n))).reshape(*lead, n)
    cfg = tile_config(n, k, x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _matmul_kernel[grid](
        a, weight, weight if bias is None else bias, out,
        m, n, k, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8, HAS_BIAS=bias is not None,
        **dot_args(_matmul_kernel, x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.reshape(*lead, n)
