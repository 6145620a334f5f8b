"""Triton kernels for the Mamba2 rows of a mixed step on the packed token layout (no padded
[rows, longest row] copy): the causal conv1d and the chunked SSD scan, each row reading its
initial state from its slot in the pool (zeros when it starts fresh) and leaving its final
state there in place. Semantics of ``conv1d_torch.causal_conv1d`` and ``ssd_torch.ssd_chunked``
applied row by row.

Everything a kernel needs about the rows comes from device tensors of the step snapshot
(``cu_query_lens``, ``token_to_row``, ``state_slots``, ``has_initial_state``): grids depend only
on the (padded) token and row counts, loop bounds are loaded on the device, so one CUDA-graph
capture serves any ragged batch of that padded size. Padding rows share the padding slot and
start fresh: their racing writes there are never read. A row whose slot is -1 is skipped: it
reads no state and keeps none (its outputs are computed for the caller to overwrite:
speculative verify rows, which run as Mamba windows).

Runs on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported), for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_mamba_decode import decay_rate, step_size
from megatron_async.kernels.triton_paged_common import dot_args


@triton.jit
def ssd_chunk(x, dt, Bc, Cc, state, A, D, causal, HAS_D: tl.constexpr, CB_DTYPE: tl.constexpr,
              CB_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One chunk of the scan for one head: x [BLOCK_T, BLOCK_P] fp32, dt [BLOCK_T] fp32 (0 past
    the row's end: identity steps), B / C [BLOCK_T, BLOCK_N] in their dtype, the entering state
    [BLOCK_P, BLOCK_N] fp32 -> (y [BLOCK_T, BLOCK_P] fp32, the state after the chunk)."""
    cum = tl.cumsum(dt * A, axis=0)  # log-decay from the chunk start to each token (<= 0)
    xdt = x * dt[:, None]
    # Intra-chunk: y_i = sum_{j <= i} exp(cum_i - cum_j) (C_i . B_j) dt_j x_j.
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
    # C . B in the inputs' dtype: 16-bit products are exact in the fp32 accumulator.
    scores = tl.dot(Cc.to(CB_DTYPE), tl.trans(Bc.to(CB_DTYPE)), input_precision=CB_PRECISION) * decay
    y = tl.dot(scores, xdt, input_precision=DOT_PRECISION)
    # The state entering the chunk, decayed to each token and read out through C.
    y += tl.dot(Cc.to(tl.float32), tl.trans(state), input_precision=DOT_PRECISION) * tl.exp(cum)[:, None]
    if HAS_D:
        y += D * x
    # Advance the state past the whole chunk.
    total = tl.sum(dt * A, axis=0)
    to_end = tl.exp(total - cum)  # [BLOCK_T] decay from each token to the chunk's end
    state = state * tl.exp(total) + tl.dot(tl.trans(xdt * to_end[:, None]), Bc.to(tl.float32), input_precision=DOT_PRECISION)
    return y, state


@triton.jit(do_not_specialize=["num_tokens"])  # one build for every (padded) token count
def _conv_out_kernel(
    x_ptr, w_ptr, bias_ptr, pool_ptr, out_ptr, slots_ptr, has_init_ptr, cu_ptr, tok_row_ptr,
    num_tokens, channels,
    stride_xt, stride_xc, stride_wc, stride_wk, stride_sb, stride_sc, stride_sk, stride_ot,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask = offs_t < num_tokens
    c_mask = offs_c < channels
    row = tl.load(tok_row_ptr + offs_t, mask=t_mask, other=0)
    start = tl.load(cu_ptr + row, mask=t_mask, other=0)
    slot = tl.load(slots_ptr + row, mask=t_mask, other=0).to(tl.int64)
    init = (tl.load(has_init_ptr + row, mask=t_mask, other=0) != 0) & (slot >= 0)
    x_dtype = x_ptr.dtype.element_ty

    # Token t of a row starting at s sees ext[t - s .. t - s + K - 1] of ext = [state (K - 1),
    # the row's tokens]: packed token src = t + k - (K - 1) when src >= s, else state entry
    # K - 1 + src - s.
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        src = offs_t + (k - (K - 1))
        in_x = (src >= start) & t_mask
        xv = tl.load(x_ptr + src[:, None].to(tl.int64) * stride_xt + offs_c[None, :] * stride_xc,
                     mask=in_x[:, None] & c_mask[None, :], other=0.0)
        in_s = (src < start) & t_mask & init
        s_off = slot[:, None] * stride_sb + offs_c[None, :] * stride_sc + (K - 1 + src - start)[:, None] * stride_sk
        sv = tl.load(pool_ptr + s_off, mask=in_s[:, None] & c_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=c_mask, other=0.0).to(tl.float32)
        acc += w[None, :] * (xv.to(tl.float32) + sv.to(x_dtype).to(tl.float32))
    out = acc / (1.0 + tl.exp(-acc))  # SiLU
    out_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + offs_c[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr, pool_ptr, slots_ptr, has_init_ptr, cu_ptr,
    channels, stride_xt, stride_xc, stride_sb, stride_sc, stride_sk,
    K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Row r's new state: ext[len .. len + K - 2], its last K - 1 inputs. Entry j is written
    after entries >= j were read (j rising), so updating the slot in place is safe."""
    row = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < channels
    start = tl.load(cu_ptr + row)
    length = tl.load(cu_ptr + row + 1) - start
    slot = tl.load(slots_ptr + row).to(tl.int64)
    init = (tl.load(has_init_ptr + row) != 0) & (slot >= 0)
    c_mask = offs_c < tl.where(slot >= 0, channels, 0)  # a skipped row keeps no state
    s_row = pool_ptr + slot * stride_sb + offs_c * stride_sc
    for j in tl.static_range(K - 1):
        e = length + j
        from_x = tl.load(x_ptr + (start + e - (K - 1)).to(tl.int64) * stride_xt + offs_c * stride_xc,
                         mask=offs_c < tl.where(e >= K - 1, channels, 0), other=0.0)
        from_state = tl.load(s_row + e * stride_sk, mask=offs_c < tl.where((e < K - 1) & init, channels, 0), other=0.0)
        val = from_x + from_state.to(x_ptr.dtype.element_ty)
        tl.store(s_row + j * stride_sk, val.to(pool_ptr.dtype.element_ty), mask=c_mask)


CONV_TILE = (8, 64, 2)
"""(tokens, channels, warps) of a ``_conv_out_kernel`` program. The hybrid's 8,192-token mixed step
(4,096 channels of a 6,176-wide projection, one H100): 116.8 us against 154.7 with 32 x 128 on 4
warps, the fastest of 60 settings (8-128 tokens x 64-512 channels x 2-8 warps); the same bits (each
output's four taps are summed in one order whatever the tile)."""


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
    slots: torch.Tensor, has_initial_state: torch.Tensor, cu_query_lens: torch.Tensor, token_to_row: torch.Tensor,
) -> torch.Tensor:
    """Packed rows x [T, c] (row r = tokens cu[r] : cu[r + 1], ``token_to_row`` [T]), weight
    [c, K], pool [S, c, K - 1] -> silu(conv) [T, c] in x's dtype; each row's final state is
    written to ``conv_pool[slots[r]]``."""
    T, c = x.shape
    R = slots.shape[0]
    k = weight.shape[1]
    if k < 2 or conv_pool.shape[1:] != (c, k - 1):
        raise ValueError(f"conv state must be [slots, {c}, {k - 1}], got {tuple(conv_pool.shape)}")
    out = torch.empty(T, c, dtype=x.dtype, device=x.device)
    if T == 0 or R == 0:
        return out
    block_c = min(128, triton.next_power_of_2(c))
    has_init = has_initial_state.contiguous().view(torch.uint8)
    cu, slots = cu_query_lens.contiguous(), slots.contiguous()
    tile_t, tile_c, warps = CONV_TILE
    tile_c = min(tile_c, triton.next_power_of_2(c))
    _conv_out_kernel[(triton.cdiv(T, tile_t), triton.cdiv(c, tile_c))](
        x, weight, x if bias is None else bias, conv_pool, out, slots, has_init, cu, token_to_row.contiguous(),
        T, c, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_pool.stride(), out.stride(0),
        K=k, BLOCK_T=tile_t, BLOCK_C=tile_c, HAS_BIAS=bias is not None, num_warps=warps,
    )
    _conv_state_kernel[(R, triton.cdiv(c, block_c))](
        x, conv_pool, slots, has_init, cu, c, x.stride(0), x.stride(1), *conv_pool.stride(), K=k, BLOCK_C=block_c,
    )
    return out


@triton.jit
def _ssd_varlen_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, pool_ptr, y_ptr, slots_ptr, has_init_ptr, cu_ptr,
    heads_per_group, head_dim, d_state, dt_min, dt_max,
    stride_xt, stride_xh, stride_xp, stride_dtt, stride_dth,
    stride_Bt, stride_Bg, stride_Bn, stride_Ct, stride_Cg, stride_Cn,
    stride_sb, stride_sh, stride_sp, stride_sn, stride_yt, stride_yh,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, CB_DTYPE: tl.constexpr, CB_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, A_IS_LOG: tl.constexpr,
):
    """One program per (row, head, block of head_dim): the row's tokens in chunks of BLOCK_T
    from its own start (the chunk boundaries of the scan), state in registers throughout; a row
    of one token takes the plain recurrent step."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_q = tl.arange(0, BLOCK_T)
    p_mask = offs_p < head_dim
    n_mask = offs_n < d_state
    group = head // heads_per_group
    A = decay_rate(A_ptr, head, A_IS_LOG)
    D = tl.load(D_ptr + head).to(tl.float32) if HAS_D else 0.0
    start = tl.load(cu_ptr + row)
    end = tl.load(cu_ptr + row + 1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    keep = (slot >= 0).to(tl.int32)  # a skipped row reads and keeps no state
    read_old = (tl.load(has_init_ptr + row) != 0).to(tl.int32) * keep

    pn_mask = p_mask[:, None] & n_mask[None, :]
    s_ptrs = pool_ptr + slot * stride_sb + head * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn
    state = tl.load(s_ptrs, mask=pn_mask & (offs_p[:, None] < head_dim * read_old), other=0.0).to(tl.float32)
    x_base = x_ptr + head * stride_xh + offs_p[None, :] * stride_xp
    B_base = B_ptr + group * stride_Bg + offs_n[None, :] * stride_Bn
    C_base = C_ptr + group * stride_Cg + offs_n[None, :] * stride_Cn
    y_base = y_ptr + head * stride_yh + offs_p[None, :]
    causal = offs_q[:, None] >= offs_q[None, :]

    if end - start == 1:  # a decode token (most rows of a mixed step): the recurrent step, no chunk matmuls
        t = start.to(tl.int64)
        dt1 = step_size(tl.load(dt_ptr + t * stride_dtt + head * stride_dth).to(tl.float32), dt_bias_ptr, head,
                        dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT)
        x1 = tl.load(x_ptr + t * stride_xt + head * stride_xh + offs_p * stride_xp, mask=p_mask, other=0.0).to(tl.float32)
        B1 = tl.load(B_ptr + t * stride_Bt + group * stride_Bg + offs_n * stride_Bn, mask=n_mask, other=0.0).to(tl.float32)
        C1 = tl.load(C_ptr + t * stride_Ct + group * stride_Cg + offs_n * stride_Cn, mask=n_mask, other=0.0).to(tl.float32)
        state = state * tl.exp(dt1 * A) + (x1 * dt1)[:, None] * B1[None, :]
        y1 = tl.sum(state * C1[None, :], axis=1)
        if HAS_D:
            y1 += D * x1
        tl.store(y_ptr + t * stride_yt + head * stride_yh + offs_p, y1, mask=p_mask)
    else:
        for t0 in tl.range(start, end, BLOCK_T):
            offs_t = t0 + offs_q
            t_mask = offs_t < end
            t64 = offs_t.to(tl.int64)
            dt = tl.load(dt_ptr + t64 * stride_dtt + head * stride_dth, mask=t_mask, other=0.0).to(tl.float32)
            dt = tl.where(t_mask, step_size(dt, dt_bias_ptr, head, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS,
                                            HAS_DT_LIMIT), 0.0)
            x = tl.load(x_base + t64[:, None] * stride_xt, mask=t_mask[:, None] & p_mask[None, :], other=0.0).to(tl.float32)
            Bc = tl.load(B_base + t64[:, None] * stride_Bt, mask=t_mask[:, None] & n_mask[None, :], other=0.0)
            Cc = tl.load(C_base + t64[:, None] * stride_Ct, mask=t_mask[:, None] & n_mask[None, :], other=0.0)
            y, state = ssd_chunk(x, dt, Bc, Cc, state, A, D, causal, HAS_D, CB_DTYPE, CB_PRECISION, DOT_PRECISION)
            tl.store(y_base + t64[:, None] * stride_yt, y, mask=t_mask[:, None] & p_mask[None, :])

    tl.store(s_ptrs, state, mask=(offs_p[:, None] < head_dim * keep) & n_mask[None, :])


def ssd_scan_varlen(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
    ssm_pool: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor, cu_query_lens: torch.Tensor,
    dt_bias: torch.Tensor | None = None, dt_softplus: bool = False, dt_limit: tuple[float, float] | None = None,
    A_is_log: bool = False,
) -> torch.Tensor:
    """Packed rows: x [T, h, p], dt [T, h], A [h], B / C [T, g, n], D [h] or None, pool [S, h, p, n]
    float32 -> y [T, h, p] float32; row r starts from ``ssm_pool[slots[r]]`` (zeros when it has no
    initial state) and leaves its final state there. dt and ``A_is_log`` as in
    ``selective_state_update`` (the same step-size math: a token's dt and A are the same bits here).
    Tiles of 16 tokens for fp32 inputs, 32 for 16-bit ones (no register spills at d_state 128
    on sm_90; exact-fp32 matmuls need far more registers)."""
    T, h, p = x.shape
    g, n = B.shape[1:]
    R = slots.shape[0]
    if ssm_pool.shape[1:] != (h, p, n) or ssm_pool.dtype != torch.float32:
        raise ValueError(f"SSM pool must be float32 [slots, {h}, {p}, {n}], got {ssm_pool.dtype} {tuple(ssm_pool.shape)}")
    if h % g != 0:
        raise ValueError(f"{h} heads are not a multiple of {g} groups")
    y = torch.empty(T, h, p, dtype=torch.float32, device=x.device)
    if T == 0 or R == 0:
        return y
    small = 16 if x.dtype == torch.float32 else 32
    block_p = max(16, min(small, triton.next_power_of_2(p)))
    cb = dot_args(_ssd_varlen_kernel, B.dtype)
    lo, hi = dt_limit if dt_limit is not None else (0.0, 0.0)
    _ssd_varlen_kernel[(R, h, triton.cdiv(p, block_p))](
        x, dt, x if dt_bias is None else dt_bias, A, B, C, x if D is None else D, ssm_pool, y,
        slots.contiguous(), has_initial_state.contiguous().view(torch.uint8), cu_query_lens.contiguous(),
        h // g, p, n, float(lo), float(hi),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *ssm_pool.stride(), y.stride(0), y.stride(1),
        BLOCK_T=small, BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(n)),
        HAS_D=D is not None, CB_DTYPE=cb["DOT_DTYPE"], CB_PRECISION=cb["DOT_PRECISION"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, HAS_DT_LIMIT=dt_limit is not None, A_IS_LOG=A_is_log,
    )
    return y
