"""The SwiGLU MLP's gate_up projection and its activation in one kernel:
``silu(x @ W_gate.T + b_gate) * (x @ W_up.T + b_up)`` without writing the [T, 2I] projection.

cuBLAS takes the gate_up GEMM and a second kernel reads its [T, 2I] output back to apply
silu(gate) * up: on a prefill step of 8,192 tokens that round trip is ~150 MB per layer.
Here each output tile's program computes the gate tile and the matching up tile (two
accumulators over one A tile, TMA loads) and applies the activation in its epilogue.
Persistent: one program per SM walks the tiles in grouped order (GROUP_M row tiles share
each weight tile while it is in L2). The program count is a runtime argument, so row counts
that give fewer tiles than SMs build no new variant.

Rounds like the unfused path: each projection is rounded to the activation dtype (as the
GEMM's output would be), silu in float32 rounded to the dtype, then the product rounded
again (``triton_act``). The projections' own bits differ from cuBLAS's (another
accumulation order), as any two GEMM implementations do; the kernel's bits do not depend
on the launch (tiles are a function of the row count only)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_async.kernels import cuda_device
from megatron_async.kernels.triton_act import silu_mul
from megatron_async.kernels.triton_invariant_matmul import grouped_tile
from megatron_async.kernels.triton_paged_common import dot_args, num_compute_units


@triton.jit(do_not_specialize=["M", "num_programs"])
def _swiglu_matmul_kernel(
    a_desc,
    w_desc,
    bias_ptr,
    out_desc,
    M,
    I,
    K,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(I, BLOCK_N)
    dt = out_desc.dtype
    # A plain loop over tiles: Triton's flattened (tile x K) pipeline measured 10 % slower here.
    for tile in range(tl.program_id(0), num_m * num_n, num_programs):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # Descriptors load zeros past M and K. Gate columns past I (last column tile) read
        # up rows: those output columns are clipped by the store; up rows past 2I load zeros.
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k0]).to(DOT_DTYPE)
            wg = w_desc.load([pid_n * BLOCK_N, k0]).to(DOT_DTYPE)
            wu = w_desc.load([I + pid_n * BLOCK_N, k0]).to(DOT_DTYPE)
            acc_gate = tl.dot(a, wg.T, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, wu.T, acc_up, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc_gate += tl.load(bias_ptr + offs_n, mask=offs_n < I, other=0.0).to(tl.float32)[None, :]
            acc_up += tl.load(bias_ptr + I + offs_n, mask=offs_n < I, other=0.0).to(tl.float32)[None, :]
        # the unfused path's roundings: projections in dt, then silu_and_mul's
        out = silu_mul(acc_gate.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32), dt)
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out)


@dataclass(frozen=True)
class SwigluTiles:
    block_m: int
    block_n: int
    """Output columns per tile (its program loads this many gate AND up weight rows)."""
    block_k: int
    num_warps: int
    num_stages: int


def swiglu_tiles(m: int, dtype: torch.dtype, device: torch.device) -> SwigluTiles:
    """Launch settings by row count (one compiled variant per bucket; M itself is not
    specialised, so a CUDA graph of any size reuses them). The sweep:
    ``python -m benchmarks kernel-times swiglu-matmul --sweep``. 4-byte types take half the K depth (the
    same shared memory)."""
    if device.type != "cuda":  # interpreter: tiles that tiny test shapes still cross
        return SwigluTiles(16, 16, 16, 1, 1)
    t = SwigluTiles(64, 64, 128, 4, 4) if m <= 256 else SwigluTiles(128, 128, 64, 8, 3)
    if dtype.itemsize == 4:
        t = dataclasses.replace(t, block_k=t.block_k // 2)
    return t


def pays_off(m: int, k: int) -> bool:
    """Whether the fused kernel should beat cuBLAS + the SiLU-mul kernel for m rows and a
    hidden size k: at qwen3-0.6b's k = 1,024 (``kernel-times swiglu-matmul --sweep``,
    docs/PERFORMANCE.md "Kernel choices") faster at <= 128 and >= 2,048 rows, slower at 256-1,024
    (cuBLAS's tiles fit the waves better). What the fusion saves,
    the SiLU round trip of the [m, 2I] projection, shrinks against the GEMM as 1 / k (~1/3 of the
    GEMM's time at k = 1,024), while Triton's GEMM runs ~12 % below cuBLAS's on this shape: past
    k ~ 2,800 (Qwen3-8B's 4,096) the fused kernel would lose (within 2-3 % either way there), so
    taken up to 2,048 only."""
    return k <= 2048 and (m <= 128 or m >= 2048)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``swiglu_linear`` takes these operands: Hopper or newer (TMA) or the CPU
    interpreter, float types, K > 0, 16-byte aligned bases and row strides, unit stride along K."""
    if x.is_cuda and cuda_device.capability(x.device)[0] < 9:
        return False
    return (x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.shape[1] == weight.shape[1] > 0 and weight.shape[0] % 2 == 0
            and x.stride(1) == 1 and weight.stride(1) == 1
            and all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, weight))
            and (weight.shape[0] // 2 * x.element_size()) % 16 == 0)


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: SwigluTiles | None = None) -> torch.Tensor:
    """x [T, K], weight [2I, K] (gate rows first, then up), bias [2I] or None -> [T, I] =
    silu(gate projection) * up projection, in x's dtype. Operands must pass ``supported``."""
    if not supported(x, weight):
        raise ValueError(f"swiglu_linear: unsupported operands x {tuple(x.shape)} {x.dtype} stride {x.stride()}, "
                         f"weight {tuple(weight.shape)} {weight.dtype} stride {weight.stride()}")
    return _launch(x, weight, bias, tiles)


def swiglu_linear_if_supported(x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``swiglu_linear``, or None where ``supported`` says no (the layers' fallback test, done once)."""
    return _launch(x, weight, bias, None) if supported(x, weight) else None


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            tiles: SwigluTiles | None) -> torch.Tensor:
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"swiglu_linear: bias {tuple(bias.shape)} {bias.dtype} does not match weight")
    m, k = x.shape
    inter = weight.shape[0] // 2
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m == 0 or inter == 0:
        return out
    t = tiles or swiglu_tiles(m, x.dtype, x.device)
    tiles_total = triton.cdiv(m, t.block_m) * triton.cdiv(inter, t.block_n)
    programs = min(num_compute_units(x.device), tiles_total)
    _swiglu_matmul_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [t.block_m, t.block_k]),
        TensorDescriptor.from_tensor(weight, [t.block_n, t.block_k]),
        weight if bias is None else bias,
        TensorDescriptor.from_tensor(out, [t.block_m, t.block_n]),
        m, inter, k, programs,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=8,
        HAS_BIAS=bias is not None, **dot_args(_swiglu_matmul_kernel, x.dtype),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out
