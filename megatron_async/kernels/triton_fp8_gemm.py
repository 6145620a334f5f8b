"""W8A8 block-scaled FP8 linear: y = x @ W.T (+ bias) with W e4m3 in 128 x 128 blocks
(``weight_scale_inv``) and x quantized per token in 1 x 128 groups (scale amax / 448, see fp8_quant).

One kernel, two ways to get the A operand:
- fused (decode-size batches): each program loads its [BLOCK_M, 128] slice of x for the current K
  group, takes the row maxima and rounds to e4m3 in registers, never writing the quantized
  activations anywhere;
- pre-quantized (``x_scale`` given; prefill-size batches): ``quantize_activation`` wrote e4m3 +
  scales once, instead of every column tile redoing it.
Both quantize with ``triton_fp8_common.quantize_groups``: the same bits either way.

Per K group (BLOCK_K = 128, the group size) the kernel takes a fresh e4m3 dot and adds it times
(activation scale x weight scale) to a float32 accumulator: the scales of a group are constant
over its 128 K elements, and Hopper's FP8 tensor-core accumulation (narrower than float32) is
promoted to float32 every 128 K, as DeepGEMM does. K % 128 != 0: the last group is partial, masked
loads give zeros (the kernel pads in registers; nothing is rejected).

``SCALE_BLOCK_N``: weight rows per scale row: 128 (the checkpoint's grid) or 1 (one scale row per
weight row: stacked parts or TP shards that do not start on a 128-row boundary, e.g. SmolLM2's
q/k/v of 576/192/192 rows). ``SPLIT_K``: K cut into fixed group-aligned ranges whose float32
partials a second kernel adds in range order (decode with few column tiles). Tiles are a function
of (N, K) and of M's bucket (<= ``DECODE_M_MAX`` rows or more) only, and of (N, K) alone with
``batch_invariant``: a row's bits do not depend on the rows beside it, on CUDA-graph padding within
a bucket, or on async vs serial. M is not specialised (one binary per bucket)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_fp8_common import emulate, quantize_groups
from megatron_async.kernels.triton_invariant_matmul import _split_sum_kernel, grouped_tile

GROUP = 128


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr, part_ptr,
    M, N, K,
    stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsg, stride_cm,
    GROUPS_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
    PREQUANT: tl.constexpr, HAS_BIAS: tl.constexpr, EMULATE: tl.constexpr,
):
    BLOCK_K: tl.constexpr = 128
    split = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m[:, None] * stride_am
    w_cols = w_ptr + offs_n[None, :] * stride_wn
    ws_rows = ws_ptr + (offs_n // SCALE_BLOCK_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g_end = tl.minimum(tl.cdiv(K, BLOCK_K), (split + 1) * GROUPS_PER_SPLIT)
    for g in range(split * GROUPS_PER_SPLIT, g_end):
        k = g * BLOCK_K + offs_k
        k_mask = k < K
        a_mask = m_mask[:, None] & k_mask[None, :]
        if PREQUANT:
            a_q = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0)
            a_s = tl.load(as_ptr + offs_m * stride_asm + g * stride_asg, mask=m_mask, other=0.0)
        else:  # rows / K past the ends load 0: they neither raise a group's max nor add to a sum
            a_q, a_s = quantize_groups(tl.load(a_rows + k[None, :], mask=a_mask, other=0.0).to(tl.float32),
                                       EMULATE)
        w_q = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        w_s = tl.load(ws_rows + g * stride_wsg, mask=n_mask, other=0.0)
        if EMULATE:  # the interpreter's dot: float32 operands (e4m3 -> float32 is exact)
            part = tl.dot(a_q.to(tl.float32), w_q.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a_q, w_q)
        acc += part * (a_s[:, None] * w_s[None, :])
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["M", "rows"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, rows, stride_xm, stride_qm, stride_sm, stride_sg,
                     BLOCK_M: tl.constexpr, EMULATE: tl.constexpr):
    """Program (row block, group): e4m3 values and the group's scale of BLOCK_M rows. Rows from M
    to ``rows`` (the buffers' padding) get zeros and a valid scale."""
    g = tl.program_id(1)
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    k = g * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=(offs_m < M)[:, None] & (k < K)[None, :],
                other=0.0).to(tl.float32)
    q, s = quantize_groups(x, EMULATE)
    live = offs_m < rows
    tl.store(q_ptr + offs_m[:, None] * stride_qm + k[None, :], q, mask=live[:, None] & (k < K)[None, :])
    tl.store(s_ptr + offs_m * stride_sm + g * stride_sg, s, mask=live)


def quantize_activation(x: torch.Tensor, pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [Mp, K] e4m3, scale [Mp, ceil(K / 128)] float32 stored K-group-major, i.e.
    strides (1, Mp): the layout ``torch._scaled_mm``'s 1 x 128 recipe wants), Mp = M rounded up
    to ``pad_rows_to`` (cuBLASLt wants 4 for that recipe); padding rows are zeros. The bits equal
    ``fp8_quant.quantize_activation``'s."""
    m, k = x.shape
    mp = -(-m // pad_rows_to) * pad_rows_to
    block_m = 16 if x.device.type == "cpu" else 32
    q = torch.empty(mp, k, dtype=torch.float8_e4m3fn, device=x.device)
    s_t = torch.empty(triton.cdiv(k, GROUP), mp, dtype=torch.float32, device=x.device)
    if mp:
        _quantize_kernel[(triton.cdiv(mp, block_m), triton.cdiv(k, GROUP))](
            x, q, s_t, m, k, mp, x.stride(0), q.stride(0), s_t.stride(1), s_t.stride(0),
            BLOCK_M=block_m, EMULATE=emulate(_quantize_kernel), num_warps=4)
    return q, s_t.t()


@dataclass(frozen=True)
class Fp8Tiles:
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int


DECODE_M_MAX = 256
"""Row counts up to this use the decode tiles (A quantized in the GEMM), which depend on (N, K)
only: a CUDA graph padded to a captured size <= 256 computes every real row with the same bits
as eager (and async == serial, batch 1 == batch 64). Hopper's FP8 wgmma is 64 rows deep anyway.
Above, the activations are quantized once by ``quantize_activation`` and the GEMM reads e4m3."""


def fp8_tiles(m: int, n: int, k: int, device: torch.device, batch_invariant: bool = False) -> Fp8Tiles:
    """Launch settings: decode tiles fill the SMs with column tiles x K splits (bandwidth-bound);
    prefill tiles are 128 x 128. CPU (interpreter): tiles tiny test shapes still cross, with a K split."""
    if device.type != "cuda":
        return Fp8Tiles(16, 32, 2 if k > GROUP else 1, 1, 1)
    if batch_invariant or m <= DECODE_M_MAX:
        groups = triton.cdiv(k, GROUP)
        block_n = 64
        split = max(1, min(4, groups // 8, triton.cdiv(2 * 132, triton.cdiv(n, block_n))))
        return Fp8Tiles(64, block_n, split, 4, 4)
    return Fp8Tiles(128, 128, 1, 8, 3)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
               scale_block_n: int = GROUP, batch_invariant: bool = False, tiles: Fp8Tiles | None = None,
               prequantize: bool | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32), weight [N, K] e4m3, weight_scale [ceil(N / scale_block_n),
    ceil(K / 128)] float32 -> [..., N] in x's dtype. ``prequantize`` (None: for more than
    ``DECODE_M_MAX`` rows, never with ``batch_invariant``) quantizes x in its own pass first."""
    lead, k = x.shape[:-1], x.shape[-1]
    a = x.reshape(-1, k)
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, n = a.shape[0], weight.shape[0]
    if weight.shape[1] != k or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: weight {tuple(weight.shape)} {weight.dtype} does not fit x {tuple(x.shape)}")
    if tuple(weight_scale.shape) != (triton.cdiv(n, scale_block_n), triton.cdiv(k, GROUP)):
        raise ValueError(f"fp8_linear: weight_scale {tuple(weight_scale.shape)} is not the grid of {n} x {k} "
                         f"in {scale_block_n} x {GROUP} blocks")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    t = tiles or fp8_tiles(m, n, k, x.device, batch_invariant)
    if prequantize is None:
        prequantize = not batch_invariant and m > DECODE_M_MAX
    xs = weight_scale  # unused by the kernel when not pre-quantized
    if prequantize:
        a, xs = quantize_activation(a)
    groups = triton.cdiv(k, GROUP)
    per_split = triton.cdiv(groups, t.split_k)
    split = triton.cdiv(groups, per_split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), split)
    bias_arg = weight_scale if bias is None else bias
    _fp8_gemm_kernel[grid](
        a, xs, weight, weight_scale, bias_arg, out, part, m, n, k,
        a.stride(0), xs.stride(0), xs.stride(1), weight.stride(0), weight_scale.stride(0), weight_scale.stride(1),
        out.stride(0),
        GROUPS_PER_SPLIT=per_split, SPLIT_K=split, BLOCK_M=t.block_m, BLOCK_N=t.block_n, GROUP_M=8,
        SCALE_BLOCK_N=scale_block_n, PREQUANT=prequantize, HAS_BIAS=bias is not None,
        EMULATE=emulate(_fp8_gemm_kernel), num_warps=t.num_warps, num_stages=t.num_stages)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](part, bias_arg, out, m, n, out.stride(0), SPLIT_K=split,
                                                       HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out.reshape(*lead, n)


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The same linear through cuBLASLt's block-scaled recipe (``torch._scaled_mm``, SM90, cuBLAS
    >= 12.9): x quantized by ``quantize_activation`` (rows padded to 4), the weight grid padded to
    a multiple of 4 columns and transposed (``scaled_mm_weight_scale``; PyTorch #166752: without
    the padding, silently wrong results). K and N multiples of 128. For measurements and the GPU
    tests; the engine runs ``fp8_linear``."""
    m = x.shape[0]
    x_q, x_scale = quantize_activation(x, pad_rows_to=4)
    y = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=scaled_mm_weight_scale(weight_scale),
                         out_dtype=x.dtype)
    return y[:m]


def scaled_mm_weight_scale(weight_scale: torch.Tensor) -> torch.Tensor:
    """[Nb, Kb] -> the [round_up(Kb, 4), Nb] view with strides (1, round_up(Kb, 4)) cuBLASLt reads."""
    nb, kb = weight_scale.shape
    kb4 = -(-kb // 4) * 4
    padded = torch.ones(nb, kb4, dtype=torch.float32, device=weight_scale.device)
    padded[:, :kb] = weight_scale
    return padded.t()
