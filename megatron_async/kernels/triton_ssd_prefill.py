"""Triton kernels for Mamba2 rows of several tokens, on the mixer's right-padded layout
(rows [M, L, ...], pads carry x = 0 and dt = 0): the causal conv1d with a carried state and
the chunked SSD scan. Semantics of ``conv1d_torch.causal_conv1d`` and ``ssd_torch.ssd_chunked``.

SSD scan design: one program per (row, head, block of head_dim) walks the row's tokens in
chunks of BLOCK_T with the [BLOCK_P, d_state] state in registers. Within a chunk it uses the
quadratic (attention-like) form, y = ((C B^T) * decay) (dt x), plus the entering state read
through C; then it advances the state by the whole chunk with one matmul. Chunks follow each
other sequentially, so parallelism is rows x heads x head_dim blocks, which fills a GPU for
realistic head counts; no inter-kernel state passing and no host syncs.

Runs on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported), for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_paged_common import dot_args


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, lengths_ptr, out_ptr, final_ptr,
    seq_len, channels,
    stride_xb, stride_xt, stride_xc, stride_wc, stride_wk,
    stride_sb, stride_sc, stride_sk,
    stride_ob, stride_ot, stride_fb, stride_fc, stride_fk,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LENGTHS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < channels
    x_row = x_ptr + row * stride_xb + offs_c * stride_xc
    s_row = state_ptr + row * stride_sb + offs_c * stride_sc
    x_dtype = x_ptr.dtype.element_ty

    # Output t sees ext[t .. t + K - 1] of ext = [state (K - 1), x]: index t + k - (K - 1)
    # of x when that is >= 0, else index t + k of the state.
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        src = offs_t + (k - (K - 1))
        in_x = (src >= 0) & (offs_t < seq_len)
        xv = tl.load(x_row[None, :] + src[:, None] * stride_xt, mask=in_x[:, None] & c_mask[None, :], other=0.0)
        in_s = src < 0
        sv = tl.load(s_row[None, :] + (offs_t + k)[:, None] * stride_sk, mask=in_s[:, None] & c_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=c_mask, other=0.0).to(tl.float32)
        acc += w[None, :] * (xv.to(tl.float32) + sv.to(x_dtype).to(tl.float32))
    out = acc / (1.0 + tl.exp(-acc))  # SiLU
    out_mask = (offs_t < seq_len)[:, None] & c_mask[None, :]
    out_ptrs = out_ptr + row * stride_ob + offs_t[:, None] * stride_ot + offs_c[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)

    # Final state: ext[len .. len + K - 2], the last K - 1 inputs of the row (names not reused
    # from above: the compiler needs one type per name across the branch).
    if pid_t == 0:
        if HAS_LENGTHS:
            length = tl.load(lengths_ptr + row).to(tl.int32)
        else:
            length = seq_len
        for j in tl.static_range(K - 1):
            e = length + j
            # Scalar conditions folded into the channel bound (a masked-off load reads nothing).
            from_x = tl.load(x_row + (e - (K - 1)) * stride_xt, mask=offs_c < tl.where(e >= K - 1, channels, 0), other=0.0)
            from_state = tl.load(s_row + e * stride_sk, mask=offs_c < tl.where(e < K - 1, channels, 0), other=0.0)
            val = from_x + from_state.to(x_dtype)
            final_ptrs = final_ptr + row * stride_fb + offs_c * stride_fc + j * stride_fk
            tl.store(final_ptrs, val.to(final_ptr.dtype.element_ty), mask=c_mask)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows x [b, l, c] after states [b, c, K - 1] -> (silu(conv) [b, l, c] in x's
    dtype, final state [b, c, K - 1] after each row's ``lengths`` tokens, in the state's dtype)."""
    b, l, c = x.shape
    k = weight.shape[1]
    if k < 2 or initial_state.shape != (b, c, k - 1):
        raise ValueError(f"initial_state must be [{b}, {c}, {k - 1}], got {tuple(initial_state.shape)}")
    out = torch.empty(b, l, c, dtype=x.dtype, device=x.device)
    final = torch.empty(b, c, k - 1, dtype=initial_state.dtype, device=x.device)
    if b == 0:
        return out, final
    block_c = min(128, triton.next_power_of_2(c))
    block_t = min(32, triton.next_power_of_2(max(l, 1)))
    grid = (b, max(1, triton.cdiv(l, block_t)), triton.cdiv(c, block_c))
    _conv_prefill_kernel[grid](
        x, weight, x if bias is None else bias, initial_state, x if lengths is None else lengths.contiguous(), out, final,
        l, c,
        *x.stride(), weight.stride(0), weight.stride(1), *initial_state.stride(),
        out.stride(0), out.stride(1), *final.stride(),
        K=k, BLOCK_T=block_t, BLOCK_C=block_c, HAS_BIAS=bias is not None, HAS_LENGTHS=lengths is not None,
    )
    return out, final


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


@triton.jit
def _ssd_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, init_ptr, y_ptr, final_ptr,
    seq_len, heads_per_group, head_dim, d_state,
    stride_xb, stride_xt, stride_xh, stride_xp,
    stride_dtb, stride_dtt, stride_dth,
    stride_Bb, stride_Bt, stride_Bg, stride_Bn,
    stride_Cb, stride_Ct, stride_Cg, stride_Cn,
    stride_ib, stride_ih, stride_ip, stride_in,
    stride_yb, stride_yt, stride_yh,
    stride_fb, stride_fh, stride_fp,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, CB_DTYPE: tl.constexpr, CB_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_q = tl.arange(0, BLOCK_T)
    p_mask = offs_p < head_dim
    n_mask = offs_n < d_state
    group = head // heads_per_group
    A = tl.load(A_ptr + head).to(tl.float32)
    D = tl.load(D_ptr + head).to(tl.float32) if HAS_D else 0.0

    pn_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(
        init_ptr + row * stride_ib + head * stride_ih + offs_p[:, None] * stride_ip + offs_n[None, :] * stride_in,
        mask=pn_mask, other=0.0,
    ).to(tl.float32)
    x_base = x_ptr + row * stride_xb + head * stride_xh + offs_p[None, :] * stride_xp
    B_base = B_ptr + row * stride_Bb + group * stride_Bg + offs_n[None, :] * stride_Bn
    C_base = C_ptr + row * stride_Cb + group * stride_Cg + offs_n[None, :] * stride_Cn
    y_base = y_ptr + row * stride_yb + head * stride_yh + offs_p[None, :]
    causal = offs_q[:, None] >= offs_q[None, :]

    for t0 in range(0, seq_len, BLOCK_T):
        offs_t = t0 + offs_q
        t_mask = offs_t < seq_len
        # Tokens past the end load zeros (dt = 0): identity steps, as the reference pads.
        dt = tl.load(dt_ptr + row * stride_dtb + offs_t * stride_dtt + head * stride_dth, mask=t_mask, other=0.0).to(tl.float32)
        x = tl.load(x_base + offs_t[:, None] * stride_xt, mask=t_mask[:, None] & p_mask[None, :], other=0.0).to(tl.float32)
        # B / C stay in their own dtype (half the registers of fp32 copies).
        Bc = tl.load(B_base + offs_t[:, None] * stride_Bt, mask=t_mask[:, None] & n_mask[None, :], other=0.0)
        Cc = tl.load(C_base + offs_t[:, None] * stride_Ct, mask=t_mask[:, None] & n_mask[None, :], other=0.0)

        y, state = ssd_chunk(x, dt, Bc, Cc, state, A, D, causal, HAS_D, CB_DTYPE, CB_PRECISION, DOT_PRECISION)
        tl.store(y_base + offs_t[:, None] * stride_yt, y, mask=t_mask[:, None] & p_mask[None, :])

    tl.store(final_ptr + row * stride_fb + head * stride_fh + offs_p[:, None] * stride_fp + offs_n[None, :], state, mask=pn_mask)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor,
    *,
    block_t: int | None = None,
    block_p: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD scan of right-padded rows: x [b, l, h, p], dt [b, l, h] (final step sizes, pads 0),
    A [h], B / C [b, l, g, n], D [h] or None, initial_state [b, h, p, n]
    -> (y [b, l, h, p], final_state [b, h, p, n]), float32.

    The block sizes only trade speed (results are equal up to rounding); every block is at
    least 16 for ``tl.dot``. Defaults: 32 x 32 for 16-bit inputs (no register spills at
    d_state 128 on sm_90); 16 x 16 for fp32 inputs, whose exact-fp32 matmuls need far more
    registers. C . B runs in the inputs' dtype (exact products); the matmuls with fp32
    operands (state, decayed dt * x) run in exact fp32 for fp32 inputs and in tf32 for
    16-bit inputs, whose own rounding dominates."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    if initial_state.shape != (b, h, p, n):
        raise ValueError(f"initial_state must be [{b}, {h}, {p}, {n}], got {tuple(initial_state.shape)}")
    if h % g != 0:
        raise ValueError(f"{h} heads are not a multiple of {g} groups")
    if B.dtype != C.dtype:
        raise TypeError(f"B and C must share a dtype, got {B.dtype} / {C.dtype}")
    y = torch.empty(b, l, h, p, dtype=torch.float32, device=x.device)
    final = torch.empty(b, h, p, n, dtype=torch.float32, device=x.device)
    if b == 0:
        return y, final
    small = 16 if x.dtype == torch.float32 else 32
    block_p = max(16, min(block_p or small, triton.next_power_of_2(p)))
    block_t = max(16, block_t or small)
    cb = dot_args(_ssd_scan_kernel, B.dtype)
    _ssd_scan_kernel[(b, h, triton.cdiv(p, block_p))](
        x, dt, A, B, C, x if D is None else D, initial_state, y, final,
        l, h // g, p, n,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *initial_state.stride(),
        y.stride(0), y.stride(1), y.stride(2), final.stride(0), final.stride(1), final.stride(2),
        BLOCK_T=block_t, BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(n)),
        HAS_D=D is not None, CB_DTYPE=cb["DOT_DTYPE"], CB_PRECISION=cb["DOT_PRECISION"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )
    return y, final
