"""Triton kernels for a Mamba2 decode window: T tokens per row (speculative verification: the
last sampled token plus T - 1 drafts), with the semantics of T sequential
``conv1d_torch.causal_conv1d_step`` / ``ssd_torch.ssd_step`` calls.

Each row starts from its committed state (``state[slots[r]]``, or zeros when
``has_initial_state[r]`` is False) and never writes it: the state after every token t goes
to ``scratch[slots[r], t]`` instead, so the caller can later commit the state of the
accepted prefix (``triton_mamba_commit``) or drop the whole window. Tokens a row does not
really have (a shorter draft padded to T) produce states nobody commits.

CUDA graphs: no host reads of device data; grids depend only on tensor shapes.
Runs on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported), for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_mamba_decode import (_row_state, _row_state_args, decay_rate, ssm_launch_sizes,
                                                          step_size)


@triton.jit
def _conv_window_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, scratch_ptr, out_ptr, slots_ptr, has_init_ptr,
    channels,
    stride_xb, stride_xt, stride_xc, stride_wc, stride_wk,
    stride_sb, stride_sc, stride_sk,
    stride_qb, stride_qt, stride_qc, stride_qk,
    stride_yb, stride_yt,
    T: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
):
    row = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < channels
    slot, read_old = _row_state(slots_ptr, has_init_ptr, row, HAS_SLOTS, HAS_INIT_FLAGS)
    old_mask = offs_c < channels * read_old  # rows without a state read nothing, start from 0
    row64 = row.to(tl.int64)
    s_row = state_ptr + slot * stride_sb + offs_c * stride_sc
    x_row = x_ptr + row64 * stride_xb + offs_c * stride_xc
    q_row = scratch_ptr + slot * stride_qb + offs_c * stride_qc
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)

    # The inputs seen so far are ext = [state_0 .. state_{K-2}, x_0 .. x_{T-1}]; token t's
    # window is ext[t : t + K] and the state after it ext[t + 1 : t + K]. t and k are
    # compile-time, so whether ext[t + k] is an old state column or an input is too.
    for t in tl.static_range(T):
        acc = bias
        for k in tl.static_range(K):
            if t + k < K - 1:  # through x's dtype first, as the reference concatenates the state onto x
                v = tl.load(s_row + (t + k) * stride_sk, mask=old_mask, other=0.0).to(x_ptr.dtype.element_ty)
            else:
                v = tl.load(x_row + (t + k - (K - 1)) * stride_xt, mask=c_mask, other=0.0)
            acc = acc + tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=c_mask, other=0.0).to(tl.float32) * v.to(tl.float32)
            if k > 0:
                tl.store(q_row + t * stride_qt + (k - 1) * stride_qk, v.to(scratch_ptr.dtype.element_ty), mask=c_mask)
        out = acc / (1.0 + tl.exp(-acc))  # SiLU
        tl.store(out_ptr + row64 * stride_yb + t * stride_yt + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_mask)


def causal_conv1d_window(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    scratch: torch.Tensor,
    slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [b, T, c], weight [c, K], state pool [S, c, K - 1] (read only), scratch
    [S, >= T, c, K - 1] -> silu(conv) [b, T, c] in x's dtype; the state after token t of row r
    goes to ``scratch[slot_r, t]`` in the scratch's dtype."""
    b, T, c = x.shape
    k = weight.shape[1]
    if k < 2 or state.shape[1:] != (c, k - 1) or scratch.shape[2:] != (c, k - 1) or scratch.shape[1] < T:
        raise ValueError(f"conv state must be [slots, {c}, {k - 1}] and scratch [slots, >= {T}, {c}, {k - 1}], "
                         f"got {tuple(state.shape)} / {tuple(scratch.shape)}")
    out = torch.empty(b, T, c, dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    block_c = min(256, triton.next_power_of_2(c))
    _conv_window_kernel[(b, triton.cdiv(c, block_c))](
        x, weight, x if bias is None else bias, state, scratch, out,
        *_row_state_args(x, slots, has_initial_state),
        c,
        *x.stride(), weight.stride(0), weight.stride(1),
        *state.stride(), *scratch.stride(), out.stride(0), out.stride(1),
        T=T, K=k, BLOCK_C=block_c,
        HAS_BIAS=bias is not None, HAS_SLOTS=slots is not None, HAS_INIT_FLAGS=has_initial_state is not None,
    )
    return out


@triton.jit
def _state_window_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
    state_ptr, scratch_ptr, y_ptr, slots_ptr, has_init_ptr,
    T, heads_per_group, head_dim, d_state, dt_min, dt_max,
    stride_xb, stride_xt, stride_xh, stride_xp,
    stride_dtb, stride_dtt, stride_dth,
    stride_Bb, stride_Bt, stride_Bg, stride_Bn,
    stride_Cb, stride_Ct, stride_Cg, stride_Cn,
    stride_sb, stride_sh, stride_sp, stride_sn,
    stride_qb, stride_qt, stride_qh, stride_qp, stride_qn,
    stride_yb, stride_yt, stride_yh,
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

    mask = p_mask[:, None] & n_mask[None, :]
    old_mask = (offs_p[:, None] < head_dim * read_old) & n_mask[None, :]  # no state: read nothing, start from 0
    tile = offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn
    state = tl.load(state_ptr + slot * stride_sb + head * stride_sh + tile, mask=old_mask, other=0.0).to(tl.float32)
    A = decay_rate(A_ptr, head, A_IS_LOG)
    D = 0.0
    if HAS_D:
        D = tl.load(D_ptr + head).to(tl.float32)
    q_head = scratch_ptr + slot * stride_qb + head * stride_qh + offs_p[:, None] * stride_qp + offs_n[None, :] * stride_qn
    for t in range(T):  # the recurrence, one token at a time, state kept in registers
        dt = step_size(tl.load(dt_ptr + row64 * stride_dtb + t * stride_dtt + head * stride_dth).to(tl.float32),
                       dt_bias_ptr, head, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT)
        x = tl.load(x_ptr + row64 * stride_xb + t * stride_xt + head * stride_xh + offs_p * stride_xp,
                    mask=p_mask, other=0.0).to(tl.float32)
        Bv = tl.load(B_ptr + row64 * stride_Bb + t * stride_Bt + group * stride_Bg + offs_n * stride_Bn,
                     mask=n_mask, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + row64 * stride_Cb + t * stride_Ct + group * stride_Cg + offs_n * stride_Cn,
                     mask=n_mask, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * A) + (x * dt)[:, None] * Bv[None, :]
        tl.store(q_head + t * stride_qt, state, mask=mask)
        y = tl.sum(state * Cv[None, :], axis=1) + D * x
        tl.store(y_ptr + row64 * stride_yb + t * stride_yt + head * stride_yh + offs_p, y, mask=p_mask)


def selective_state_window(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    scratch: torch.Tensor,
    slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    A_is_log: bool = False,
) -> torch.Tensor:
    """T SSM steps per row: x [b, T, h, p], dt [b, T, h], A [h], B / C [b, T, g, n], D [h] or
    None, state pool [S, h, p, n] float32 (read only), scratch [S, >= T, h, p, n] float32 ->
    y [b, T, h, p] float32; the state after token t of row r goes to ``scratch[slot_r, t]``.
    dt and ``A_is_log`` as in ``selective_state_update``."""
    b, T, h, p = x.shape
    if state.dim() != 4 or scratch.dim() != 5 or scratch.shape[1] < T:
        raise ValueError(f"SSM state must be [slots, h, p, n] and scratch [slots, >= {T}, h, p, n], "
                         f"got {tuple(state.shape)} / {tuple(scratch.shape)}")
    block_p, block_n = ssm_launch_sizes(h, p, B, state, scratch)
    y = torch.empty(b, T, h, p, dtype=torch.float32, device=x.device)
    if b == 0:
        return y
    lo, hi = dt_limit if dt_limit is not None else (0.0, 0.0)
    _state_window_kernel[(b, h, triton.cdiv(p, block_p))](
        x, dt, x if dt_bias is None else dt_bias, A, B, C, x if D is None else D,
        state, scratch, y,
        *_row_state_args(x, slots, has_initial_state),
        T, h // B.shape[2], p, B.shape[3], float(lo), float(hi),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        *state.stride(), *scratch.stride(), y.stride(0), y.stride(1), y.stride(2),
        BLOCK_P=block_p, BLOCK_N=block_n,
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        HAS_DT_LIMIT=dt_limit is not None, HAS_SLOTS=slots is not None, HAS_INIT_FLAGS=has_initial_state is not None,
        A_IS_LOG=A_is_log,
    )
    return y


@triton.jit
def _commit_kernel(pool_ptr, scratch_ptr, slots_ptr, accepted_ptr, rows_ptr, numel, stride_pool, stride_qb, stride_qt,
                   BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    commit = 1
    if HAS_ROWS:
        commit = (tl.load(rows_ptr + row) != 0).to(tl.int32)
    mask = offs < numel * commit  # rows left out touch nothing
    slot = tl.load(slots_ptr + row).to(tl.int64)
    t = tl.load(accepted_ptr + row).to(tl.int64)
    v = tl.load(scratch_ptr + slot * stride_qb + t * stride_qt + offs, mask=mask)
    tl.store(pool_ptr + slot * stride_pool + offs, v, mask=mask)


def commit_window_state(
    pool: torch.Tensor, scratch: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """``pool[slots[r]] = scratch[slots[r], accepted[r]]`` for every row r (where ``rows[r]``,
    when given), on the device: only those slots are written, straight from the scratch (no
    gathered temporary)."""
    per_state = pool[0].numel()
    if not (pool.is_contiguous() and scratch.is_contiguous()) or scratch[0, 0].numel() != per_state:
        raise ValueError(f"commit needs contiguous pool [S, ...] and scratch [S, T, ...] of one state shape, "
                         f"got {tuple(pool.shape)} / {tuple(scratch.shape)}")
    if scratch.dtype != pool.dtype:
        raise TypeError(f"scratch dtype {scratch.dtype} != pool dtype {pool.dtype}")
    R = slots.shape[0]
    if R == 0:
        return
    block = min(1024, triton.next_power_of_2(per_state))
    _commit_kernel[(R, triton.cdiv(per_state, block))](
        pool, scratch, slots.contiguous(), accepted.contiguous(), slots if rows is None else rows.contiguous().view(torch.uint8),
        per_state, pool.stride(0), scratch.stride(0), scratch.stride(1), BLOCK=block, HAS_ROWS=rows is not None,
    )
