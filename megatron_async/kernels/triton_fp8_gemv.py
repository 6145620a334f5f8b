"""W8A8 block-scaled FP8 linear for a row or two (batch-1 decode) on the CUDA cores: the tensor-core
GEMM's 16-row tiles waste 15 of 16 rows there, stage the weights through shared memory, and need a
split of K (and a second kernel adding the splits) to spread ~100 column tiles over the GPU.

Each program takes one row and ``block_n`` weight rows over the whole K, ``groups`` K groups (of 128)
per step: it reads the [block_n, groups, 128] e4m3 weights with 16-byte loads straight into
registers, quantizes the row's activations of those groups in registers (``quantize_groups``: the
GEMM's bits, or reads them pre-quantized) and adds, per group, sum_k(w_q x_q) (float32) times
(activation scale x weight scale). The same block math as the GEMM; the 128-term sums are float32
(the tensor core's in-group accumulation is narrower), so the bits differ from the GEMM's. A row's
bits depend only on (N, K) and the launch settings, never on the other rows."""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_async.kernels.triton_fp8_common import quantize_groups



@triton.jit(do_not_specialize=["M"])
def fp8_gemv_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr, M, N, K,
                    stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsg, stride_cm,
                    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
                    PREQUANT: tl.constexpr, HAS_BIAS: tl.constexpr, EMULATE: tl.constexpr):
    GROUP_K: tl.constexpr = 128  # the K group of a scale (``GROUP``)
    pid = tl.program_id(0)
    row = (pid % M).to(tl.int64)  # a column tile's rows run side by side: its weights come from L2 after the first
    offs_n = ((pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    g_off = tl.arange(0, GROUPS)
    e_off = tl.arange(0, GROUP_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None, None] * stride_wn
    ws_rows = ws_ptr + (offs_n // SCALE_BLOCK_N)[:, None] * stride_wsn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g0 in range(0, tl.cdiv(K, GROUP_K), GROUPS):
        gi = g0 + g_off
        k = gi[:, None] * GROUP_K + e_off[None, :]  # [GROUPS, 128]
        k_mask = k < K
        # the weights first: they come from DRAM, the row's activations from L2, and their loads
        # should be in flight while the row's groups are quantized
        w_q = tl.load(w_rows + k[None, :, :], mask=n_mask[:, None, None] & k_mask[None, :, :], other=0.0)
        w_s = tl.load(ws_rows + gi[None, :] * stride_wsg, mask=n_mask[:, None] & (gi * GROUP_K < K)[None, :],
                      other=0.0)
        if PREQUANT:
            a_q = tl.load(a_ptr + row * stride_am + k, mask=k_mask, other=0.0)
            a_s = tl.load(as_ptr + row * stride_asm + gi * stride_asg, mask=gi * GROUP_K < K, other=0.0)
        else:  # K past the end loads 0: it neither raises a group's max nor adds to a sum
            a_q, a_s = quantize_groups(tl.load(a_ptr + row * stride_am + k, mask=k_mask, other=0.0).to(tl.float32),
                                       EMULATE)
        part = tl.sum(w_q.to(tl.float32) * a_q.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
        acc += tl.sum(part * (a_s[None, :] * w_s), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + row * stride_cm + offs_n, acc.to(c_ptr.dtype.element_ty), mask=n_mask)


def gemv_grid(m: int, n: int, block_n: int) -> tuple[int]:
    return (m * triton.cdiv(n, block_n),)
