"""An MLP's first projection and its activation in one kernel, without writing the projection:
``silu(x @ W_gate.T + b_gate) * (x @ W_up.T + b_up)`` (SwiGLU's gate_up) or
``relu(x @ W_up.T + b_up)^2`` (NemotronH's up).

cuBLAS takes the GEMM and a second kernel reads its output back to apply the activation: on a
prefill step of 8,192 tokens that round trip is ~150 MB per SwiGLU layer (~130 MB for
NemotronH's 4,096-wide up), and at decode sizes the second launch. Here each output tile's program
computes its projection tile(s) (gate and up: two accumulators over one A tile; TMA loads) and
applies the activation in its epilogue. Persistent: one program per SM walks the tiles in grouped
order (GROUP_M row tiles share each weight tile while it is in L2). The program count is a runtime
argument, so row counts that give fewer tiles than SMs build no new variant.

Rounds like the unfused path: each projection is rounded to the activation dtype (as the
GEMM's output would be), then the activation as ``triton_act`` rounds it (silu in float32 rounded
to the dtype, the product rounded again; relu(h)^2 rounded once, torch's bits). The projections'
own bits differ from cuBLAS's (another accumulation order), as any two GEMM implementations do;
the kernel's bits do not depend on the launch (tiles are a function of the row count only)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_async.kernels import cuda_device, launch_limits
from megatron_async.kernels.triton_act import relu_sq, silu_mul
from megatron_async.kernels.triton_gemm_common import grouped_tile
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
    GATED: tl.constexpr,
):
    """I output columns: silu(gate) * up of a [2I, K] weight (``GATED``), else relu(up)^2 of an [I, K] one."""
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
            if GATED:
                wg = w_desc.load([pid_n * BLOCK_N, k0]).to(DOT_DTYPE)
                wu = w_desc.load([I + pid_n * BLOCK_N, k0]).to(DOT_DTYPE)
                acc_gate = tl.dot(a, wg.T, acc_gate, input_precision=DOT_PRECISION)
            else:
                wu = w_desc.load([pid_n * BLOCK_N, k0]).to(DOT_DTYPE)
            acc_up = tl.dot(a, wu.T, acc_up, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc_up += tl.load(bias_ptr + I * GATED + offs_n, mask=offs_n < I, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_gate += tl.load(bias_ptr + offs_n, mask=offs_n < I, other=0.0).to(tl.float32)[None, :]
        # the unfused path's roundings: projections in dt, then the activation kernel's
        if GATED:
            out = silu_mul(acc_gate.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32), dt)
        else:
            out = relu_sq(acc_up.to(dt).to(tl.float32), dt)
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out)


@dataclass(frozen=True)
class ActTiles:
    block_m: int
    block_n: int
    """Output columns per tile (a SwiGLU program loads this many gate AND up weight rows)."""
    block_k: int
    num_warps: int
    num_stages: int


_ACT_TABLE = (ActTiles(64, 64, 128, 4, 4), ActTiles(128, 128, 64, 8, 3), ActTiles(64, 128, 128, 4, 4),
              ActTiles(128, 128, 64, 4, 4), ActTiles(128, 256, 64, 8, 3))
"""Every launch ``act_tiles`` prefers for some bucket; a fallback picks among these."""


def footprint(gated: bool, elem_bytes: int):
    """A [block_m, block_k] A tile and one (relu^2) or two (SwiGLU: gate and up) [block_n, block_k]
    weight tiles a step, one accumulator each; the output tile stored through shared memory."""
    def of(t: ActTiles) -> launch_limits.Footprint:
        return launch_limits.gemm_footprint(t.block_m, t.block_n, t.block_k, t.num_stages, t.num_warps, elem_bytes,
                                            elem_bytes, 2 if gated else 1, elem_bytes)
    return of


def act_tiles(m: int, dtype: torch.dtype, device: torch.device, gated: bool = True,
              limits: launch_limits.DeviceLimits | None = None) -> ActTiles:
    """Launch settings by row count (one compiled variant per bucket; M itself is not
    specialised, so a CUDA graph of any size reuses them), fitted to ``limits`` (default: the
    device's). The sweep: ``python -m benchmarks kernel-times swiglu-matmul --sweep [--act relu2]``.
    4-byte types take half the K depth (the same shared memory)."""
    if device.type != "cuda":  # interpreter: tiles that tiny test shapes still cross
        return ActTiles(16, 16, 16, 1, 1)
    if gated:
        t = _ACT_TABLE[0] if m <= 256 else _ACT_TABLE[1]
    elif m <= 512:  # relu^2 (NemotronH's up, I 4,096, K 1,024): the sweep's best per bucket
        t = _ACT_TABLE[0] if m <= 128 else (_ACT_TABLE[2] if m <= 256 else _ACT_TABLE[3])
    else:
        t = _ACT_TABLE[4]
    table = _ACT_TABLE
    if dtype.itemsize == 4:  # and at most 128 columns: a 128 x 256 float32 output tile alone takes 128 KB
        narrow = [dataclasses.replace(e, block_k=e.block_k // 2, block_n=min(e.block_n, 128)) for e in (t, *table)]
        t, table = narrow[0], tuple(narrow[1:])
    limits = limits or launch_limits.device_limits(device)
    return launch_limits.fit(t, footprint(gated, dtype.itemsize), limits, table)


def pays_off(m: int, k: int, gated: bool = True) -> bool:
    """Whether the fused kernel should beat cuBLAS + the activation kernel for m rows and a
    hidden size k. SwiGLU at qwen3-0.6b's k = 1,024 (``kernel-times swiglu-matmul --sweep``,
    docs/PERFORMANCE.md "Kernel choices"): faster at <= 128 and >= 2,048 rows, slower at 256-1,024
    (cuBLAS's tiles fit the waves better). What the fusion saves,
    the SiLU round trip of the [m, 2I] projection, shrinks against the GEMM as 1 / k (~1/3 of the
    GEMM's time at k = 1,024), while Triton's GEMM runs ~12 % below cuBLAS's on this shape: past
    k ~ 2,800 (Qwen3-8B's 4,096) the fused kernel would lose (within 2-3 % either way there), so
    taken up to 2,048 only. relu^2 (NemotronH's up, k = 1,024, I = 4,096, ``--act relu2``): faster
    at every row count measured, 1-8,192 (0.75-0.95x the time), with ``act_tiles``' buckets; the same
    bound on k."""
    if not gated:
        return k <= 2048
    return k <= 2048 and (m <= 128 or m >= 2048)


def _columns(weight: torch.Tensor, gated: bool) -> int:
    """Output columns: I of a [2I, K] gate_up weight (``gated``) or of an [I, K] up weight."""
    return weight.shape[0] // 2 if gated else weight.shape[0]


def _name(gated: bool) -> str:
    return "swiglu_linear" if gated else "relu2_linear"


def supported(x: torch.Tensor, weight: torch.Tensor, gated: bool = True) -> bool:
    """Whether ``swiglu_linear`` (``gated``) / ``relu2_linear`` takes these operands: Hopper or newer
    (TMA) or the CPU interpreter, float types, K > 0, 16-byte aligned bases and row strides (the
    output's too), unit stride along K."""
    if x.is_cuda and cuda_device.capability(x.device)[0] < 9:
        return False
    return (x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.shape[1] == weight.shape[1] > 0 and (not gated or weight.shape[0] % 2 == 0)
            and x.stride(1) == 1 and weight.stride(1) == 1
            and all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, weight))
            and (_columns(weight, gated) * x.element_size()) % 16 == 0)


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: ActTiles | None = None) -> torch.Tensor:
    """x [T, K], weight [2I, K] (gate rows first, then up), bias [2I] or None -> [T, I] =
    silu(gate projection) * up projection, in x's dtype. Operands must pass ``supported``."""
    return _checked(x, weight, bias, tiles, True)


def relu2_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tiles: ActTiles | None = None) -> torch.Tensor:
    """x [T, K], weight [I, K], bias [I] or None -> [T, I] = relu(projection)^2, in x's dtype.
    Operands must pass ``supported(x, weight, gated=False)``."""
    return _checked(x, weight, bias, tiles, False)


def swiglu_linear_if_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                               gated: bool = True) -> torch.Tensor | None:
    """``swiglu_linear`` (``relu2_linear`` when not ``gated``), or None where ``supported`` says no
    (the layers' fallback test, done once)."""
    return _launch(x, weight, bias, None, gated) if supported(x, weight, gated) else None


def _checked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: ActTiles | None,
             gated: bool) -> torch.Tensor:
    if not supported(x, weight, gated):
        raise ValueError(f"{_name(gated)}: unsupported operands x {tuple(x.shape)} {x.dtype} stride {x.stride()}, "
                         f"weight {tuple(weight.shape)} {weight.dtype} stride {weight.stride()}")
    return _launch(x, weight, bias, tiles, gated)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            tiles: ActTiles | None, gated: bool) -> torch.Tensor:
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"{_name(gated)}: bias {tuple(bias.shape)} {bias.dtype} does not match weight")
    m, k = x.shape
    inter = _columns(weight, gated)
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m == 0 or inter == 0:
        return out
    t = tiles or act_tiles(m, x.dtype, x.device, gated)
    tiles_total = triton.cdiv(m, t.block_m) * triton.cdiv(inter, t.block_n)
    programs = min(num_compute_units(x.device), tiles_total)
    _swiglu_matmul_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [t.block_m, t.block_k]),
        TensorDescriptor.from_tensor(weight, [t.block_n, t.block_k]),
        weight if bias is None else bias,
        TensorDescriptor.from_tensor(out, [t.block_m, t.block_n]),
        m, inter, k, programs,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=8,
        HAS_BIAS=bias is not None, **dot_args(_swiglu_matmul_kernel, x.dtype), GATED=gated,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out
