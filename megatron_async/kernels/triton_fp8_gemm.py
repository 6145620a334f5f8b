"""W8A8 block-scaled FP8 linear: y = x @ W.T (+ bias) with W e4m3 in 128 x 128 blocks
(``weight_scale_inv``) and x quantized per token in 1 x 128 groups (scale amax / 448, see fp8_quant).

Who computes a call (``fp8_linear``; measured on an H100 at the Qwen3-8B and 0.6B linears,
``python -m benchmarks fp8 kernels`` and ``fp8 sweep``):
- up to ``GEMV_M_MAX`` rows (batch-1 decode; not in batch-invariant mode), ``triton_fp8_gemv`` on
  the CUDA cores, one row a program, no split of K;
- up to ``SMALL_M`` rows (decode), the Triton kernel below with the activations quantized inside
  it: each program loads its [16, 128] slice of x per K group, takes the row maxima and rounds to
  e4m3 in registers, never writing the quantized activations anywhere;
- up to ``TRITON_M_MAX`` rows (``DECODE_M_MAX`` for N <= ``SMALL_N``), the same kernel over
  activations ``quantize_activation`` wrote once (e4m3 + scales), instead of every column tile
  redoing it;
- above, cuBLASLt's block-scaled recipe (``torch._scaled_mm``) where it takes the call, else this
  kernel over pre-quantized activations.
All Triton ways quantize with ``triton_fp8_common.quantize_groups``: the same bits either way.

Per K group (BLOCK_K = 128, the group size) the kernel takes a fresh e4m3 dot and adds it times
(activation scale x weight scale) to a float32 accumulator: the scales of a group are constant
over its 128 K elements, and Hopper's FP8 tensor-core accumulation (narrower than float32) is
promoted to float32 every 128 K, as DeepGEMM does. K % 128 != 0: the last group is partial, masked
loads give zeros (the kernel pads in registers; nothing is rejected).

``SCALE_BLOCK_N``: weight rows per scale row: 128 (the checkpoint's grid) or 1 (one scale row per
weight row: stacked parts or TP shards that do not start on a 128-row boundary, e.g. SmolLM2's
q/k/v of 576/192/192 rows). ``SPLIT_K``: K cut into fixed group-aligned ranges whose float32
partials a second kernel adds in range order (decode with few column tiles); the groups of a
range are a runtime argument, so one binary serves every K and split of a tile shape. Tiles are a function
of (N, K) and of M's bucket only, and of (N, K) alone with ``batch_invariant`` (always Triton): a
row's bits do not depend on the rows beside it, on CUDA-graph padding within a bucket, or on
async vs serial. M is not specialised (one binary per bucket)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from megatron_async.kernels import launch_limits
from megatron_async.kernels.triton_fp8_act import QuantizedRows
from megatron_async.kernels.triton_fp8_common import emulate, quantize_groups
from megatron_async.kernels.triton_fp8_gemv import fp8_gemv_kernel, gemv_grid
from megatron_async.kernels.triton_gemm_common import grouped_tile
from megatron_async.kernels.triton_invariant_matmul import _split_sum_kernel
from megatron_async.kernels.triton_paged_common import num_compute_units

GROUP = 128
log = logging.getLogger("megatron_async")


@triton.jit(do_not_specialize=["M", "groups_per_split"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr, part_ptr,
    M, N, K, groups_per_split,
    stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsg, stride_cm,
    SPLIT: tl.constexpr,
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
    g_end = tl.minimum(tl.cdiv(K, BLOCK_K), (split + 1) * groups_per_split)
    for g in range(split * groups_per_split, g_end):
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
    if not SPLIT:
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
    rows = QuantizedRows.empty(m, k, x.dtype, x.device, pad_rows_to)
    mp, block_m = rows.rows_padded, 16 if x.device.type == "cpu" else 32
    if mp:
        _quantize_kernel[(triton.cdiv(mp, block_m), triton.cdiv(k, GROUP))](
            x, rows.q, rows.scale, m, k, mp, x.stride(0), rows.q.stride(0), rows.scale.stride(0), rows.scale.stride(1),
            BLOCK_M=block_m, EMULATE=emulate(_quantize_kernel), num_warps=4)
    return rows.q, rows.scale


@dataclass(frozen=True)
class Fp8Tiles:
    """Launch settings. ``block_m`` 1: one row a program on the CUDA cores (``triton_fp8_gemv``),
    ``groups`` K groups of 128 a step, no split."""
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    groups: int = 1


GEMV_M_MAX = 1
"""Rows up to this go to the CUDA-core kernel (``triton_fp8_gemv``, ``_gemv_tiles``); 0: off. On an
H100 at one row (``fp8 sweep --family gemv --m 1``, us, these settings against the 16-row tiles with
their split sum): Qwen3-8B qkv 12.2 / 14.6, o 8.5 / 11.8, gate_up 36.0 / 42.4, down (K 12,288) 20.7 /
24.3 + the sum; Qwen3-0.6B qkv 4.1 / 6.9, o 3.1 / 6.5, gate_up 4.8 / 7.9, down 4.2 / 7.8. Qwen3-8B
batch-1 decode (``fp8 engine --model qwen3-8b --configs fp8``, one H100): 4.39 ms a token with the
tiles, 4.07 with this kernel where K <= 4,096 and its older settings, 3.86 now."""
GEMV_TILES = Fp8Tiles(1, 8, 1, 4, 1, 16)
"""Its launch settings: at most 8 weight rows a program (fewer where N is small, ``GEMV_PROGRAMS``),
16 K groups a step; 8 warps for K above 4,096 (the sweep's best at each of the 8B's and 0.6B's linears
or within 3 % of it)."""
GEMV_PROGRAMS = 2
"""Programs per SM the CUDA-core kernel's ``block_n`` aims at (a power of two, 2 to 8 rows)."""
SMALL_M = 16
"""Rows up to this (decode): 16-row tiles quantizing A in the GEMM; that costs no more than a
separate quantize launch there (H100, Qwen3-8B linears, M = 1: 1.4-1.8x faster than cuBLAS bf16)."""
TRITON_M_MAX = 64
"""Rows above this go to cuBLASLt's block-scaled recipe where it takes the call
(``scaled_mm_takes``): on an H100 it is 1.3-1.5x faster than bf16 for prefill-sized M and about
bf16's speed from 128 rows, where this kernel (one dot per 128-K group scaled into a float32
accumulator, no warp specialisation) reaches ~0.75x bf16. Between ``SMALL_M`` and here: 64-row
tiles over pre-quantized activations (in-GEMM quantization of 64-row tiles is 2-3x slower)."""
DECODE_M_MAX = 256
"""Rows up to this: 64-row tiles where cuBLASLt does not take the call (no recipe; N <= ``SMALL_N``:
64 x 128 tiles split over K, buckets up to 128 and up to 256 rows), above it 128-row tiles."""
SMALL_N = 2048
"""Up to ``DECODE_M_MAX`` rows, weights of at most this many rows stay in Triton: cuBLASLt's
128 x 128 output tiles leave most SMs idle (H100, N = 1024 at 128 rows: Qwen3-0.6B's o 9.2 us
against 10.7, down 9.7 against 13.3; N = 4096 and up: cuBLASLt faster)."""


def footprint(a_bytes: int, out_bytes: int):
    """Each step: [block_m, 128 x groups] activations of ``a_bytes``, [block_n, 128 x groups] e4m3 weights."""
    return lambda t: launch_limits.gemm_footprint(t.block_m, t.block_n, GROUP * t.groups, t.num_stages, t.num_warps,
                                                  a_bytes, 1, out_bytes=out_bytes)


def _split_k(n: int, k: int, block_n: int, programs: int, row_tiles: int, most: int, min_groups: int,
             device: torch.device) -> int:
    """K splits (a power of two <= ``most``, >= ``min_groups`` groups each) so that row tiles x column
    tiles x splits come near ``programs`` per SM: the decode GEMM is bandwidth-bound and few
    column tiles leave SMs idle. ``row_tiles``: those of the bucket's largest M (not M itself)."""
    tiles = row_tiles * triton.cdiv(n, block_n)
    want = max(1, min(most, triton.cdiv(k, GROUP) // min_groups, programs * num_compute_units(device) // tiles))
    return 1 << (want.bit_length() - 1)


def _gemv_tiles(n: int, k: int, device: torch.device) -> Fp8Tiles:
    want = max(2, min(GEMV_TILES.block_n, n // (GEMV_PROGRAMS * num_compute_units(device))))
    return replace(GEMV_TILES, block_n=1 << (want.bit_length() - 1), num_warps=8 if k > 4096 else GEMV_TILES.num_warps,
                   groups=min(GEMV_TILES.groups, triton.next_power_of_2(triton.cdiv(k, GROUP))))


def fp8_tiles(m: int, n: int, k: int, device: torch.device, batch_invariant: bool = False) -> tuple[Fp8Tiles, bool]:
    """(tiles, prequantize) of the Triton GEMM. Tiles are a function of (N, K) and of M's bucket
    (``GEMV_M_MAX``, ``SMALL_M``, ``TRITON_M_MAX``, 128 for N <= ``SMALL_N``, ``DECODE_M_MAX``), and
    of (N, K) alone with ``batch_invariant``: a row's bits do not depend on the rows beside it or
    on CUDA-graph padding within a bucket. Quantizing A in the GEMM or before gives the same bits.
    Measured on an H100 at the Qwen3-8B and 0.6B linears (``python -m benchmarks fp8 sweep``).
    CPU (interpreter): tiles tiny test shapes still cross, with a K split."""
    if device.type != "cuda":
        if m <= GEMV_M_MAX and not batch_invariant:
            return Fp8Tiles(1, 32, 1, 1, 1, 2), False
        return Fp8Tiles(16, 32, 2 if k > GROUP else 1, 1, 1), batch_invariant or m > SMALL_M
    if batch_invariant:
        split = max(1, min(4, triton.cdiv(k, GROUP) // 8, triton.cdiv(2 * 132, triton.cdiv(n, 64))))
        return Fp8Tiles(64, 64, split, 4, 4), True
    if m <= GEMV_M_MAX:
        return _gemv_tiles(n, k, device), False
    if m <= SMALL_M:
        return Fp8Tiles(16, 64, _split_k(n, k, 64, 4, 1, 16, 2, device), 4, 3), False
    if m <= TRITON_M_MAX:
        return Fp8Tiles(64, 32, _split_k(n, k, 32, 4, 1, 8, 1, device), 4, 3), True
    if m <= DECODE_M_MAX:
        if n <= SMALL_N:  # taken from cuBLASLt: few column tiles, so split K
            row_tiles = 2 if m <= 128 else DECODE_M_MAX // 64
            return Fp8Tiles(64, 128, _split_k(n, k, 128, 1, row_tiles, 8, 1, device), 8, 3), True
        return Fp8Tiles(64, 64, min(2, _split_k(n, k, 64, 4, 1, 8, 4, device)), 4, 4), True
    return Fp8Tiles(128, 64, 1, 4, 3), True


def scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, scale_block_n: int,
                    batch_invariant: bool) -> bool:
    """Whether ``fp8_linear`` hands this call to ``torch._scaled_mm``: more than ``TRITON_M_MAX``
    rows (more than ``DECODE_M_MAX`` for N <= ``SMALL_N``) of bf16 / fp16 on a GPU whose cuBLASLt
    runs the 1 x 128 / 128 x 128 recipe, the checkpoint's 128-row scale grid, N a multiple of 128
    and K of 512 (``scaled_mm_weight_scale``: the weight scales are read in place, so an in-place
    weight update reaches them). Never in batch-invariant mode (cuBLAS's kernel choice depends on M).
    x [M, K]: only its row count, dtype and device are read (``scaled_mm_takes_rows``)."""
    return scaled_mm_takes_rows(x.numel() // weight.shape[1], x.dtype, x.device, weight, weight_scale, scale_block_n,
                                batch_invariant)


def scaled_mm_takes_rows(m: int, dtype: torch.dtype, device: torch.device, weight: torch.Tensor,
                         weight_scale: torch.Tensor, scale_block_n: int, batch_invariant: bool) -> bool:
    """``scaled_mm_takes`` for m input rows of ``dtype`` on ``device``."""
    n, k = weight.shape
    return (not batch_invariant and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and m > (TRITON_M_MAX if n > SMALL_N else DECODE_M_MAX)
            and scale_block_n == GROUP and n % GROUP == 0 and k % (4 * GROUP) == 0
            and weight.stride(1) == 1 and weight_scale.is_contiguous() and scaled_mm_runs(device))


_SCALED_MM_RUNS: dict[torch.device, bool] = {}


def scaled_mm_runs(device: torch.device) -> bool:
    """Whether cuBLASLt's block-scaled recipe runs on ``device`` (tried once, outside any CUDA-graph
    capture, and logged when it does not; while capturing before it was tried: False). The trial
    draws no random numbers: an engine's CUDA generator may be registered for graph capture."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    if device not in _SCALED_MM_RUNS:
        if torch.cuda.is_current_stream_capturing():
            return False
        from megatron_async.kernels.fp8_quant import quantize_weight

        try:
            w = torch.linspace(-1.0, 1.0, 256 * 512, device=device).view(256, 512)
            q, s = quantize_weight(w)
            scaled_mm_linear(w[:8].to(torch.bfloat16), q, s)
            _SCALED_MM_RUNS[device] = True
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            log.warning("FP8: cuBLASLt's block-scaled recipe does not run on %s (%s: %s); the Triton GEMM computes "
                        "every FP8 linear", device, type(e).__name__, str(e).splitlines()[0][:200])
            _SCALED_MM_RUNS[device] = False
    return _SCALED_MM_RUNS[device]


def settle_fp8_linears(model: torch.nn.Module, device: torch.device) -> None:
    """Decide now whether cuBLASLt takes the large FP8 calls of ``model`` (when it has FP8 weights):
    a decision first asked for inside a CUDA-graph capture could not be tried there."""
    if any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):
        scaled_mm_runs(device)


def fp8_linear_prequantizes(m: int, dtype: torch.dtype, device: torch.device, weight: torch.Tensor,
                            weight_scale: torch.Tensor, scale_block_n: int) -> bool:
    """Whether ``fp8_linear`` would quantize m rows of ``dtype`` on ``device`` in a pass of its own
    (cuBLASLt, or the Triton GEMM over pre-quantized rows): there their producer should hand them
    over as ``QuantizedRows`` (``triton_fp8_act``). False off CUDA and where the GEMM quantizes in
    registers (a few rows) or on the CUDA cores (one)."""
    if device.type != "cuda" or m <= 0 or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    n, k = weight.shape
    return (scaled_mm_takes_rows(m, dtype, device, weight, weight_scale, scale_block_n, False)
            or fp8_tiles(m, n, k, device)[1])


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, scale_block_n: int = GROUP, batch_invariant: bool = False,
               tiles: Fp8Tiles | None = None, prequantize: bool | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32), weight [N, K] e4m3, weight_scale [ceil(N / scale_block_n),
    ceil(K / 128)] float32 -> [..., N] in x's dtype. ``tiles`` / ``prequantize`` override
    ``fp8_tiles``'s choice (and keep the call in Triton). x may come quantized (``QuantizedRows``,
    where ``fp8_linear_prequantizes``): the same bits, without the quantize pass."""
    if isinstance(x, QuantizedRows):
        return _prequantized_linear(x, weight, weight_scale, bias, scale_block_n)
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
    if m == 0 or n == 0:
        return torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    if tiles is None and prequantize is None and scaled_mm_takes(a, weight, weight_scale, scale_block_n,
                                                                 batch_invariant):
        out = scaled_mm_linear(a, weight, weight_scale)
        return (out if bias is None else out + bias).reshape(*lead, n)
    planned, pre = fp8_tiles(m, n, k, x.device, batch_invariant)
    return _triton_linear(a, weight, weight_scale, bias, scale_block_n, tiles or planned,
                          pre if prequantize is None else prequantize).reshape(*lead, n)


def _prequantized_linear(x: QuantizedRows, weight, weight_scale, bias, scale_block_n: int) -> torch.Tensor:
    m, n = x.m, weight.shape[0]
    if weight.shape[1] != x.q.shape[1] or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: weight {tuple(weight.shape)} {weight.dtype} does not fit {x.q.shape[1]} inputs")
    if scaled_mm_takes_rows(m, x.dtype, x.device, weight, weight_scale, scale_block_n, False):
        y = torch._scaled_mm(x.q, weight.t(), scale_a=x.scale, scale_b=scaled_mm_weight_scale(weight_scale),
                             out_dtype=x.dtype)[:m]
        return y if bias is None else y + bias
    t, pre = fp8_tiles(m, n, x.q.shape[1], x.device)
    if not pre:
        raise ValueError(f"fp8_linear: {m} rows of {tuple(weight.shape)} are quantized in the GEMM, not before it")
    return _triton_linear(x.q[:m], weight, weight_scale, bias, scale_block_n, t, True, (x.scale[:m], x.dtype))


def _triton_linear(a, weight, weight_scale, bias, scale_block_n: int, t: Fp8Tiles, prequantize: bool,
                   quantized: tuple[torch.Tensor, torch.dtype] | None = None) -> torch.Tensor:
    """``quantized``: a is already e4m3, with these scales and this output dtype."""
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=a.dtype if quantized is None else quantized[1], device=a.device)
    xs = weight_scale  # unused by the kernel when not pre-quantized
    if quantized is not None:
        xs = quantized[0]
    elif prequantize:
        a, xs = quantize_activation(a)
    bias_arg = weight_scale if bias is None else bias
    t = launch_limits.fit(t, footprint(a.element_size(), out.element_size()), launch_limits.device_limits(a.device))
    if t.block_m == 1:
        fp8_gemv_kernel[gemv_grid(m, n, t.block_n)](
            a, xs, weight, weight_scale, bias_arg, out, m, n, k, a.stride(0), xs.stride(0), xs.stride(1),
            weight.stride(0), weight_scale.stride(0), weight_scale.stride(1), out.stride(0),
            BLOCK_N=t.block_n, GROUPS=t.groups, SCALE_BLOCK_N=scale_block_n, PREQUANT=prequantize,
            HAS_BIAS=bias is not None, EMULATE=emulate(fp8_gemv_kernel), num_warps=t.num_warps,
            num_stages=t.num_stages)
        return out
    groups = triton.cdiv(k, GROUP)
    per_split = triton.cdiv(groups, t.split_k)
    split = triton.cdiv(groups, per_split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=a.device) if split > 1 else out
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), split)
    _fp8_gemm_kernel[grid](
        a, xs, weight, weight_scale, bias_arg, out, part, m, n, k, per_split,
        a.stride(0), xs.stride(0), xs.stride(1), weight.stride(0), weight_scale.stride(0), weight_scale.stride(1),
        out.stride(0),
        SPLIT=split > 1, BLOCK_M=t.block_m, BLOCK_N=t.block_n, GROUP_M=8,
        SCALE_BLOCK_N=scale_block_n, PREQUANT=prequantize, HAS_BIAS=bias is not None,
        EMULATE=emulate(_fp8_gemm_kernel), num_warps=t.num_warps, num_stages=t.num_stages)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](part, bias_arg, out, m, n, out.stride(0), SPLIT_K=split,
                                                       HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The same linear through cuBLASLt's block-scaled recipe (``torch._scaled_mm``, SM90, cuBLAS
    >= 12.9): x quantized by ``quantize_activation`` (rows padded to 4, the scales' leading
    dimension with them: PyTorch #166752, without the padding silently wrong results), the weight
    grid transposed in place (``scaled_mm_weight_scale``). N a multiple of 128, K of 512.
    ``fp8_linear`` calls it where ``scaled_mm_takes``."""
    m = x.shape[0]
    x_q, x_scale = quantize_activation(x, pad_rows_to=4)
    y = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=scaled_mm_weight_scale(weight_scale),
                         out_dtype=x.dtype)
    return y[:m]


def scaled_mm_weight_scale(weight_scale: torch.Tensor) -> torch.Tensor:
    """[Nb, Kb] -> the [Kb, Nb] view (strides (1, Kb)) cuBLASLt reads: the grid itself, in place.
    Kb must be a multiple of 4 (K of 512): torch 2.11 refuses every other layout we tried for
    the 128 x 128 recipe ("Invalid scaling configuration")."""
    nb, kb = weight_scale.shape
    if kb % 4 or not weight_scale.is_contiguous():
        raise ValueError(f"scaled_mm_linear: a contiguous weight scale grid with a multiple of 4 K groups, not "
                         f"{tuple(weight_scale.shape)}")
    return weight_scale.t()
