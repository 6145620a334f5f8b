"""Activations handed to an FP8 linear already quantized (``QuantizedRows``), by the kernel that
produces them, where ``fp8_linear`` would otherwise quantize them in a pass of its own.

Above ``triton_fp8_gemm.SMALL_M`` rows the FP8 linear reads its input as e4m3 + 1 x 128 group
scales that ``quantize_activation`` writes first (cuBLASLt's block-scaled recipe, or the Triton
GEMM over pre-quantized rows): one more launch, a read of the bf16 rows and a write of the e4m3
ones. ``silu_and_mul_quantized`` computes SwiGLU's ``silu(gate) * up`` (``relu_square_quantized``
NemotronH's relu(h)^2) and quantizes it in the same kernel, so the activation is never written in bf16 nor read back: the bits equal
``triton_act.silu_and_mul`` then ``quantize_activation`` (the product rounded to the activation
dtype first, as the unfused path stores it); ``rms_norm_quantized`` does the same for a block's
(add +) RMSNorm. ``triton_fp8_gemm.fp8_linear_prequantizes`` says where the FP8 linear would take
such rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_act import relu_sq, silu_mul
from megatron_async.kernels.triton_fp8_common import emulate, quantize_groups
from megatron_async.kernels.triton_rmsnorm import norm_row, num_warps

GROUP = 128
PAD_ROWS = 4
"""Rows of ``QuantizedRows`` come padded to this (zeros): cuBLASLt's 1 x 128 recipe wants it."""


@dataclass(frozen=True)
class QuantizedRows:
    """m rows of K activations as ``quantize_activation(x, pad_rows_to=PAD_ROWS)`` leaves them:
    ``q`` [Mp, K] e4m3, ``scale`` [Mp, ceil(K / 128)] float32 stored K-group-major (strides (1, Mp));
    ``dtype``: the activation dtype (the linear's output's). Rows past m are zeros where the
    producer writes them (SwiGLU, the norm), else unwritten (attention): a linear's output row
    reads its own input row only, and rows past m are dropped."""
    q: torch.Tensor
    scale: torch.Tensor
    m: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.m, self.q.shape[1]

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_cuda(self) -> bool:
        return self.q.is_cuda

    @classmethod
    def empty(cls, m: int, k: int, dtype: torch.dtype, device: torch.device, pad_rows: int = PAD_ROWS) -> QuantizedRows:
        """Unwritten buffers for m rows of k (padded to ``pad_rows``; the scales K-group-major)."""
        mp = -(-m // pad_rows) * pad_rows
        return cls(torch.empty(mp, k, dtype=torch.float8_e4m3fn, device=device),
                   torch.empty(triton.cdiv(k, GROUP), mp, dtype=torch.float32, device=device).t(), m, dtype)

    @property
    def rows_padded(self) -> int:
        return self.q.shape[0]


@triton.jit(do_not_specialize=["M", "rows"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, rows, stride_x, stride_qm, stride_sm, stride_sg,
                      I: tl.constexpr, BLOCK_M: tl.constexpr, GATED: tl.constexpr, DT: tl.constexpr,
                      EMULATE: tl.constexpr):
    """Program (row block, group of 128 columns of the activation): silu(gate) * up (``GATED``, x
    [M, 2I]) or relu(x)^2 (x [M, I]) rounded to DT, then its e4m3 values and group scale; rows from
    M to ``rows`` (padding) get zeros and a scale."""
    g = tl.program_id(1)
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    k = g * 128 + tl.arange(0, 128)
    mask = (offs_m < M)[:, None] & (k < I)[None, :]
    first = tl.load(x_ptr + offs_m[:, None] * stride_x + k[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(x_ptr + offs_m[:, None] * stride_x + I + k[None, :], mask=mask, other=0.0).to(tl.float32)
        act = silu_mul(first, up, DT).to(tl.float32)  # silu(0) * 0 = 0 on masked lanes
    else:
        act = relu_sq(first, DT).to(tl.float32)
    q, s = quantize_groups(act, EMULATE)
    live = offs_m < rows
    tl.store(q_ptr + offs_m[:, None] * stride_qm + k[None, :], q, mask=live[:, None] & (k < I)[None, :])
    tl.store(s_ptr + offs_m * stride_sm + g * stride_sg, s, mask=live)


_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def store_heads_quantized(o, tok, heads, rows_mask, q_ptr, s_ptr, rows_padded, width, DT: tl.constexpr,
                          EMULATE: tl.constexpr):
    """An attention kernel's output rows o [R, 128] float32 (head ``heads`` of token ``tok`` each:
    one 128-wide group of the o projection's [T, width] input) rounded to ``DT`` as its output
    would be stored, then quantized into ``QuantizedRows``' buffers (``attention_output_rows``)."""
    q, s = quantize_groups(o.to(DT).to(tl.float32), EMULATE)
    d = tl.arange(0, 128)
    tok = tok.to(tl.int64)
    tl.store(q_ptr + tok[:, None] * width + heads[:, None] * 128 + d[None, :], q, mask=rows_mask[:, None])
    tl.store(s_ptr + heads * rows_padded + tok, s, mask=rows_mask)


def attention_outputs(q: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, QuantizedRows | None, dict]:
    """An attention kernel's outputs for queries q [T, H, D]: (the [T, H, D] output, None, the
    kernel's unused quantized-output arguments), or with ``quantize`` (D = 128) an empty output,
    unwritten ``QuantizedRows`` of [T, H * 128] (``store_heads_quantized`` fills the real rows) and
    the kernel's arguments for them (``oq_ptr``, ``os_ptr``, ``rows_padded``, ``QUANT_OUT``)."""
    tokens, heads, head_dim = q.shape
    if not quantize:
        out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
        return out, None, dict(oq_ptr=out, os_ptr=out, rows_padded=0, QUANT_OUT=False)
    if head_dim != GROUP:
        raise ValueError(f"attention: a quantized output needs head_dim {GROUP} (one group a head), got {head_dim}")
    rows = QuantizedRows.empty(tokens, heads * GROUP, q.dtype, q.device)
    out = torch.empty((0, heads, head_dim), dtype=q.dtype, device=q.device)
    return out, rows, dict(oq_ptr=rows.q, os_ptr=rows.scale, rows_padded=rows.rows_padded, QUANT_OUT=True)


def silu_and_mul_quantized(gate_up: torch.Tensor) -> QuantizedRows:
    """[T, 2I] (gate columns first, then up; unit last stride) -> silu(gate) * up as ``QuantizedRows``."""
    return _activation_quantized(gate_up, True)


def relu_square_quantized(h: torch.Tensor) -> QuantizedRows:
    """[T, I] (unit last stride) -> relu(h)^2 as ``QuantizedRows`` (the bits of ``triton_act.relu_square``
    then ``quantize_activation``)."""
    return _activation_quantized(h, False)


def _activation_quantized(x: torch.Tensor, gated: bool) -> QuantizedRows:
    if x.dim() != 2 or (gated and x.shape[1] % 2) or x.stride(1) != 1 or x.dtype not in _DTYPES:
        raise ValueError(f"the quantizing activation takes a [T, {'2I' if gated else 'I'}] tensor with unit last "
                         f"stride, got {tuple(x.shape)} {x.dtype}")
    m, inter = x.shape[0], x.shape[1] // (2 if gated else 1)
    rows = QuantizedRows.empty(m, inter, x.dtype, x.device)
    mp, block_m = rows.rows_padded, 16 if x.device.type == "cpu" else 32
    if mp and inter:
        _act_quant_kernel[(triton.cdiv(mp, block_m), triton.cdiv(inter, GROUP))](
            x, rows.q, rows.scale, m, mp, x.stride(0), rows.q.stride(0), rows.scale.stride(0), rows.scale.stride(1),
            I=inter, BLOCK_M=block_m, GATED=gated, DT=_DTYPES[x.dtype], EMULATE=emulate(_act_quant_kernel),
            num_warps=4)
    return rows


@triton.jit(do_not_specialize=["M", "rows"])
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, M, rows, stride_x, stride_r, eps,
                           N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                           CAST_BEFORE_WEIGHT: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr):
    """One program per row of the padded rows: ``triton_rmsnorm.norm_row`` (the residual sum stored
    for rows below M), then its 128-wide groups quantized; rows from M on norm a zero row (zeros
    and the scale of an all-zero group, as ``quantize_activation`` pads)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < tl.where(row < M, N, 0)  # padding rows load nothing
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    r = x
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
    y = norm_row(x, r, w_ptr, res_out_ptr, row, offs, mask, eps, N, HAS_RESIDUAL, CAST_BEFORE_WEIGHT, DT)
    q, sc = quantize_groups(tl.reshape(y.to(tl.float32), [BLOCK_N // 128, 128]), EMULATE)
    groups = tl.arange(0, BLOCK_N // 128)
    cols = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(q_ptr + row * N + cols, q, mask=cols < N)  # the grid is the padded rows
    tl.store(s_ptr + groups * rows + row, sc, mask=groups * 128 < N)


def rms_norm_quantized(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       cast_before_weight: bool) -> tuple[QuantizedRows, torch.Tensor | None]:
    """(``triton_rmsnorm.add_rms_norm``'s (or ``rms_norm``'s, ``residual`` None) normed rows as
    ``QuantizedRows``, the residual sum or None): the bits of the norm then ``quantize_activation``."""
    if x.dim() != 2:
        raise ValueError(f"rms_norm_quantized: x must be [T, hidden], got {tuple(x.shape)}")
    m, n = x.shape
    if (n < GROUP or weight.shape != (n,) or weight.dtype != x.dtype or x.dtype not in _DTYPES
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))):
        raise ValueError(f"rms_norm_quantized: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    rows = QuantizedRows.empty(m, n, x.dtype, x.device)
    mp = rows.rows_padded
    res_out = None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if mp:
        block = triton.next_power_of_2(n)  # the norm kernel's: its row sum adds in the same order
        _rms_norm_quant_kernel[(mp,)](
            x, x if residual is None else residual, weight, rows.q, rows.scale, x if res_out is None else res_out, m,
            mp, x.stride(0), 0 if residual is None else residual.stride(0), eps, N=n, BLOCK_N=block,
            HAS_RESIDUAL=residual is not None, CAST_BEFORE_WEIGHT=cast_before_weight, DT=_DTYPES[x.dtype],
            EMULATE=emulate(_rms_norm_quant_kernel), num_warps=num_warps(block))
    return rows, res_out
