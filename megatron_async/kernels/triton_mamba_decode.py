"""Triton kernels for one Mamba2 decode token per row: the causal-conv1d state update and the
selective (SSM) state update, with the semantics of ``conv1d_torch.causal_conv1d_step`` and
``ssd_torch.ssd_step``.

State protocol (both kernels): row r reads its state at ``state[slots[r]]`` (``state[r]``
when slots is None), or starts from zeros when ``has_initial_state[r]`` is False (then the
pool is not read at all, so a fresh slot may hold anything), and writes the new state back
there: the pools are updated in place, no gather / scatter copies. In place is race-free because every
element is loaded and stored by the same thread of the same program (same tile layout for
load and store) and distinct rows use distinct slots.

CUDA graphs: no host reads of device data; grids depend only on tensor shapes.
Runs on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported), for tests.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Correctly rounded exp / log1p from libdevice on CUDA (torch's results for dt and A); the
# interpreter has no libdevice, and its tl.exp / tl.log are numpy's.
EXACT_MATH = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def exact_exp(x):
    """exp, correctly rounded on CUDA (libdevice; numpy's under the interpreter)."""
    if EXACT_MATH:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _row_state(slots_ptr, has_init_ptr, row, HAS_SLOTS: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr):
    """(slot of the row as int64, 1 when its old state is read else 0)."""
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + row).to(tl.int64)
    else:
        slot = row.to(tl.int64)
    if HAS_INIT_FLAGS:
        read_old = (tl.load(has_init_ptr + row) != 0).to(tl.int32)
    else:
        read_old = 1
    return slot, read_old


def _row_state_args(dummy: torch.Tensor, slots: torch.Tensor | None, has_init: torch.Tensor | None) -> tuple:
    """Kernel pointers for slots / has_initial_state (a never-read dummy where absent)."""
    return (
        dummy if slots is None else slots.contiguous(),
        dummy if has_init is None else has_init.contiguous().view(torch.uint8),
    )


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, slots_ptr, has_init_ptr,
    channels,
    stride_xb, stride_xc, stride_wc, stride_wk,
    stride_sb, stride_sc, stride_sk,
    stride_yb,
    K: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
):
    row = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < channels
    slot, read_old = _row_state(slots_ptr, has_init_ptr, row, HAS_SLOTS, HAS_INIT_FLAGS)
    old_mask = offs_c < channels * read_old  # rows without a state read nothing, start from 0

    # The window is [state_0 .. state_{K-2}, x], oldest first; each column is its own
    # [BLOCK_C] vector so the shift below needs no cross-thread data movement.
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xb + offs_c * stride_xc, mask=c_mask, other=0.0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    s_row = state_ptr + slot * stride_sb + offs_c * stride_sc
    for k in tl.static_range(K - 1):
        # Through x's dtype first, as the reference concatenates the state onto x.
        old = tl.load(s_row + k * stride_sk, mask=old_mask, other=0.0).to(x_ptr.dtype.element_ty)
        acc += tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=c_mask, other=0.0).to(tl.float32) * old.to(tl.float32)
        if k > 0:  # new state_{k-1} = old state_k
            tl.store(s_row + (k - 1) * stride_sk, old.to(state_ptr.dtype.element_ty), mask=c_mask)
    acc += tl.load(w_ptr + offs_c * stride_wc + (K - 1) * stride_wk, mask=c_mask, other=0.0).to(tl.float32) * x.to(tl.float32)
    tl.store(s_row + (K - 2) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=c_mask)
    out = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(out_ptr + row.to(tl.int64) * stride_yb + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_mask)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [b, c], weight [c, K], state pool [S, c, K - 1] -> silu(conv) [b, c] in x's dtype.

    Row r's window is its old state (or zeros) then x[r]; the shifted window is written back
    to the row's slot of ``state``, in its dtype."""
    b, c = x.shape
    k = weight.shape[1]
    if k < 2 or state.shape[1:] != (c, k - 1):
        raise ValueError(f"conv state must be [slots, {c}, {k - 1}], got {tuple(state.shape)}")
    out = torch.empty(b, c, dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    block_c = min(256, triton.next_power_of_2(c))
    _conv_update_kernel[(b, triton.cdiv(c, block_c))](
        x, weight, x if bias is None else bias, state, out,
        *_row_state_args(x, slots, has_initial_state),
        c,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        *state.stride(), out.stride(0),
        K=k, BLOCK_C=block_c,
        HAS_BIAS=bias is not None, HAS_SLOTS=slots is not None, HAS_INIT_FLAGS=has_initial_state is not None,
    )
    return out


@triton.jit
def step_size(dt, dt_bias_ptr, head, dt_min, dt_max,
              HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr):
    """The fp32 step size from raw fp32 ``dt`` (a value or a vector of one head): bias, softplus,
    clamp (each when asked). torch's softplus: log1p(exp(x)), identity above 20."""
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + head).to(tl.float32)
    if DT_SOFTPLUS:
        if EXACT_MATH:
            soft = libdevice.log1p(exact_exp(dt))
        else:
            soft = tl.log(1.0 + exact_exp(dt))
        dt = tl.where(dt > 20.0, dt, soft)
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt


@triton.jit
def decay_rate(A_ptr, head, A_IS_LOG: tl.constexpr):
    """A of the head in fp32: as stored, or -exp(A_log) when A_IS_LOG."""
    a = tl.load(A_ptr + head).to(tl.float32)
    if A_IS_LOG:
        a = -exact_exp(a)
    return a


def ssm_launch_sizes(x_heads: int, head_dim: int, B: torch.Tensor, *pools: torch.Tensor) -> tuple[int, int]:
    """Check SSM pools ([..., h, p, n] float32) against x's heads / head_dim and B's groups and
    state size; return the (BLOCK_P, BLOCK_N) tile: <= 2048 state values a program."""
    h, p, (g, n) = x_heads, head_dim, B.shape[-2:]
    for pool in pools:
        if pool.shape[-3:] != (h, p, n):
            raise ValueError(f"SSM state must end in [{h}, {p}, {n}], got {tuple(pool.shape)}")
        if pool.dtype != torch.float32:
            raise TypeError("SSM states are float32")
    if h % g != 0:
        raise ValueError(f"{h} heads are not a multiple of {g} groups")
    block_n = triton.next_power_of_2(n)
    return max(1, min(triton.next_power_of_2(p), 2048 // block_n)), block_n


@triton.jit
def _state_update_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
    state_ptr, y_ptr, slots_ptr, has_init_ptr,
    heads_per_group, head_dim, d_state, dt_min, dt_max,
    stride_xb, stride_xh, stride_xp,
    stride_dtb, stride_dth,
    stride_Bb, stride_Bg, stride_Bn,
    stride_Cb, stride_Cg, stride_Cn,
    stride_sb, stride_sh, stride_sp, stride_sn,
    stride_yb, stride_yh,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    HAS_SLOTS: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, A_IS_LOG: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_mask = offs_p < head_dim
    n_mask = offs_n < d_state
    group = head // heads_per_group
    slot, read_old = _row_state(slots_ptr, has_init_ptr, row, HAS_SLOTS, HAS_INIT_FLAGS)
    row64 = row.to(tl.int64)

    dt = step_size(tl.load(dt_ptr + row64 * stride_dtb + head * stride_dth).to(tl.float32), dt_bias_ptr, head,
                   dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT)
    decay = tl.exp(dt * decay_rate(A_ptr, head, A_IS_LOG))

    x = tl.load(x_ptr + row64 * stride_xb + head * stride_xh + offs_p * stride_xp, mask=p_mask, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + row64 * stride_Bb + group * stride_Bg + offs_n * stride_Bn, mask=n_mask, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + row64 * stride_Cb + group * stride_Cg + offs_n * stride_Cn, mask=n_mask, other=0.0).to(tl.float32)

    tile = offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn
    mask = p_mask[:, None] & n_mask[None, :]
    old_mask = (offs_p[:, None] < head_dim * read_old) & n_mask[None, :]  # no state: read nothing, start from 0
    old = tl.load(state_ptr + slot * stride_sb + head * stride_sh + tile, mask=old_mask, other=0.0)
    new = old.to(tl.float32) * decay + (x * dt)[:, None] * Bv[None, :]
    tl.store(state_ptr + slot * stride_sb + head * stride_sh + tile, new, mask=mask)

    y = tl.sum(new * Cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(D_ptr + head).to(tl.float32) * x
    tl.store(y_ptr + row64 * stride_yb + head * stride_yh + offs_p, y, mask=p_mask)


def selective_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    A_is_log: bool = False,
) -> torch.Tensor:
    """One SSM step per row: x [b, h, p], dt [b, h], A [h], B / C [b, g, n], D [h] or None,
    state pool [S, h, p, n] float32 -> y [b, h, p] float32; the new state goes back to the
    row's slot of ``state``, in place.

    dt is used as given unless asked: ``dt_bias`` added, then softplus, then clamped to
    ``dt_limit`` (the mixer's order), all in float32. ``A_is_log``: A holds A_log (A = -exp(A_log)).
    A, D and dt_bias are read in their stored dtype."""
    b, h, p = x.shape
    block_p, block_n = ssm_launch_sizes(h, p, B, state)
    y = torch.empty(b, h, p, dtype=torch.float32, device=x.device)
    if b == 0:
        return y
    lo, hi = dt_limit if dt_limit is not None else (0.0, 0.0)
    _state_update_kernel[(b, h, triton.cdiv(p, block_p))](
        x, dt, x if dt_bias is None else dt_bias, A, B, C, x if D is None else D,
        state, y,
        *_row_state_args(x, slots, has_initial_state),
        h // B.shape[1], p, B.shape[2], float(lo), float(hi),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        *state.stride(), y.stride(0), y.stride(1),
        BLOCK_P=block_p, BLOCK_N=block_n,
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        HAS_DT_LIMIT=dt_limit is not None, HAS_SLOTS=slots is not None, HAS_INIT_FLAGS=has_initial_state is not None,
        A_IS_LOG=A_is_log,
    )
    return y
