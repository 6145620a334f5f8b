"""Triton kernels for the SSD scan of a mixed step on the packed token layout: every row starts
from its slot's state (zeros when it starts fresh) and leaves its final state there in place.
Semantics of ``ssd_torch.ssd_chunked`` applied row by row.

Two launches, as Mamba2's chunked algorithm splits the work:
- ``_ssd_state_kernel``, one program per (row, head, block of head_dim), walks the row's tokens
  in sub-chunks with the state in registers (one ``x^T B`` product a sub-chunk), leaving the state
  entering each CHUNK-token chunk of the row, each token's step size and log-decay from its
  chunk's start, and the final state in the pool. A row of one token (the decode rows of a mixed
  step) takes the recurrent step there and is done: the same math as the decode kernel.
- ``_ssd_chunk_out_kernel`` walks independent items (chunk, block of its tokens, head, block of
  head_dim): y = the entering state read out through C and decayed, plus the chunk's causal part
  (C . B^T masked by the decays) applied to dt x, plus D x.
So no program carries a chain of output matmuls through a row. With 16-bit inputs the products
take 16-bit operands and float32 accumulators, as Mamba2's reference kernels do (the buffered
chunk states too; the carried and final states stay float32); float32 inputs compute in float32.
The hybrid's 8,192-token mixed step (32 heads of 64, 8 groups, d_state 128; one H100): 275 us a
layer against 344 for a program per (row, head, 32 dims) walking its row with every product in
registers (`y` within 2e-3 of it, the states within 1e-3).

Rows and chunks come from ``cu_query_lens`` on the device: grids depend only on the (padded)
token and row counts and the device, so one CUDA graph capture serves any ragged batch of that
padded size. Scratch: one state per chunk, at most cdiv(T, CHUNK) + min(rows, T / 2) of them
([h, p, n] 16-bit each). Padding rows share the padding slot and start fresh: their racing
writes there are never read. A row whose slot is -1 reads no state and keeps none (its outputs
are computed for the caller to overwrite: speculative verify rows).

Runs on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported), for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_mamba_decode import decay_rate, step_size
from megatron_async.kernels.triton_paged_common import dot_args, num_compute_units

CHUNK = 128
"""Tokens of a scan chunk (from each row's own start): one buffered state per chunk."""
STATE_TILE = (64, 64, 4, 2)
"""(tokens of a sub-chunk, head_dim block, warps, stages) of ``_ssd_state_kernel`` for 16-bit inputs.
OUT_TILE, OUT_PROGRAMS_PER_SM: (tokens, head_dim block, warps, stages) of an ``_ssd_chunk_out_kernel``
item, and its programs an SM (each walks the step's items, so none runs empty: a grid of every
possible item spent ~20 us starting empty programs). The hybrid's 8,192-token mixed step, both
kernels (``kernel-times mamba-mixed --sweep``, one H100): 277 us; 300-337 at the 6 other walks,
278-366 at the 6 other item settings."""
OUT_TILE = (64, 64, 4, 1)
OUT_PROGRAMS_PER_SM = 4
ROW_BLOCK = 128
"""Rows a program sums at a time when it counts chunks."""
WIDE_TILE = (32, 32, 4, 2)
"""Both kernels' tiles for float32 inputs (exact-fp32 matmuls need far more registers)."""


@triton.jit
def _chunks_before(cu_ptr, row, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr):
    """Chunks of the rows before ``row``: rows of several tokens take cdiv(length, CHUNK) chunks,
    the others none (rows in blocks of BLOCK_R, so one build serves every row count)."""
    total = 0
    for r0 in range(0, row, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < row
        lengths = tl.load(cu_ptr + offs_r + 1, mask=r_mask, other=0) - tl.load(cu_ptr + offs_r, mask=r_mask, other=0)
        total += tl.sum(tl.where(lengths > 1, (lengths + CHUNK - 1) // CHUNK, 0), axis=0)
    return total


@triton.jit
def _step_sizes(dt_ptr, offs_t, t_mask, head, stride_dtt, stride_dth, dt_bias_ptr, dt_min, dt_max,
                HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr):
    """The tokens' fp32 step sizes of one head (0 past the row's end: identity steps)."""
    dt = tl.load(dt_ptr + offs_t.to(tl.int64) * stride_dtt + head * stride_dth, mask=t_mask, other=0.0).to(tl.float32)
    return tl.where(t_mask, step_size(dt, dt_bias_ptr, head, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT), 0.0)


@triton.jit(do_not_specialize=["stride_ch"])  # one build for every token count
def _ssd_state_kernel(
    x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, pool_ptr, y_ptr, buf_ptr, cum_ptr, steps_ptr, table_ptr,
    slots_ptr, has_init_ptr, cu_ptr,
    heads_per_group, head_dim, d_state, dt_min, dt_max,
    stride_xt, stride_xh, stride_xp, stride_dtt, stride_dth,
    stride_Bt, stride_Bg, stride_Bn, stride_Ct, stride_Cg, stride_Cn,
    stride_sb, stride_sh, stride_sp, stride_sn, stride_yt, stride_yh, stride_bc, stride_bh, stride_bp, stride_ch,
    CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_D: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, A_IS_LOG: tl.constexpr,
):
    """Program (row, head, block of head_dim). A row of several tokens also leaves, for the output
    kernel, the state entering each of its chunks (``buf``), each token's step size and log-decay
    from its chunk's start (``steps``, ``cum`` [h, T]: the head_dim block 0 program) and each
    chunk's (first token, end) (``table``: that of head 0 too)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_q = tl.arange(0, BLOCK_T)
    p_mask = offs_p < head_dim
    n_mask = offs_n < d_state
    group = head // heads_per_group
    A = decay_rate(A_ptr, head, A_IS_LOG)
    start = tl.load(cu_ptr + row)
    end = tl.load(cu_ptr + row + 1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    keep = (slot >= 0).to(tl.int32)  # a skipped row reads and keeps no state
    read_old = (tl.load(has_init_ptr + row) != 0).to(tl.int32) * keep

    pn_mask = p_mask[:, None] & n_mask[None, :]
    s_ptrs = pool_ptr + slot * stride_sb + head * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn
    state = tl.load(s_ptrs, mask=pn_mask & (offs_p[:, None] < head_dim * read_old), other=0.0).to(tl.float32)

    if end - start == 1:  # a decode token: the recurrent step (the decode kernel's math), its output too
        t = start.to(tl.int64)
        dt1 = step_size(tl.load(dt_ptr + t * stride_dtt + head * stride_dth).to(tl.float32), dt_bias_ptr, head,
                        dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT)
        x1 = tl.load(x_ptr + t * stride_xt + head * stride_xh + offs_p * stride_xp, mask=p_mask, other=0.0).to(tl.float32)
        B1 = tl.load(B_ptr + t * stride_Bt + group * stride_Bg + offs_n * stride_Bn, mask=n_mask, other=0.0).to(tl.float32)
        C1 = tl.load(C_ptr + t * stride_Ct + group * stride_Cg + offs_n * stride_Cn, mask=n_mask, other=0.0).to(tl.float32)
        state = state * tl.exp(dt1 * A) + (x1 * dt1)[:, None] * B1[None, :]
        y1 = tl.sum(state * C1[None, :], axis=1)
        if HAS_D:
            y1 += tl.load(D_ptr + head).to(tl.float32) * x1
        tl.store(y_ptr + t * stride_yt + head * stride_yh + offs_p, y1, mask=p_mask)
    elif end - start > 1:
        first = _chunks_before(cu_ptr, row, CHUNK, BLOCK_R)
        lead = (tl.program_id(2) == 0).to(tl.int32)  # 1: writes the tokens' step sizes and decays
        b_ptrs = buf_ptr + head * stride_bh + offs_p[:, None] * stride_bp + offs_n[None, :]
        x_base = x_ptr + head * stride_xh + offs_p[None, :] * stride_xp
        B_base = B_ptr + group * stride_Bg + offs_n[None, :] * stride_Bn
        run = 0.0  # log-decay from the chunk's start to the sub-chunk's
        for t0 in tl.range(start, end, BLOCK_T):
            if (t0 - start) % CHUNK == 0:  # a chunk starts: its entering state, its extent
                chunk = (first + (t0 - start) // CHUNK).to(tl.int64)
                tl.store(b_ptrs + chunk * stride_bc, state.to(buf_ptr.dtype.element_ty), mask=pn_mask)
                two = tl.arange(0, 2)
                tl.store(table_ptr + chunk * 2 + two, tl.where(two == 0, t0, tl.minimum(t0 + CHUNK, end)),
                         mask=two < 2 * lead * (head == 0).to(tl.int32))
                run = 0.0
            offs_t = t0 + offs_q
            t_mask = offs_t < end
            t64 = offs_t.to(tl.int64)
            dt = _step_sizes(dt_ptr, offs_t, t_mask, head, stride_dtt, stride_dth, dt_bias_ptr, dt_min, dt_max,
                             HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT)
            x = tl.load(x_base + t64[:, None] * stride_xt, mask=t_mask[:, None] & p_mask[None, :], other=0.0).to(tl.float32)
            Bc = tl.load(B_base + t64[:, None] * stride_Bt, mask=t_mask[:, None] & n_mask[None, :], other=0.0)
            cum = tl.cumsum(dt * A, axis=0)
            total = tl.sum(dt * A, axis=0)
            lead_mask = offs_t < end * lead
            tl.store(cum_ptr + head * stride_ch + t64, run + cum, mask=lead_mask)
            tl.store(steps_ptr + head * stride_ch + t64, dt, mask=lead_mask)
            run += total
            xdt = x * (dt * tl.exp(total - cum))[:, None]  # each token's input decayed to the sub-chunk's end
            state = state * tl.exp(total) + tl.dot(tl.trans(xdt.to(DOT_DTYPE)), Bc.to(DOT_DTYPE),
                                                   input_precision=DOT_PRECISION)

    tl.store(s_ptrs, state, mask=(offs_p[:, None] < head_dim * keep) & n_mask[None, :])


@triton.jit(do_not_specialize=["num_rows", "stride_ch"])  # one build for every row and token count
def _ssd_chunk_out_kernel(
    x_ptr, B_ptr, C_ptr, D_ptr, y_ptr, buf_ptr, cum_ptr, steps_ptr, table_ptr, cu_ptr,
    num_rows, num_heads, heads_per_group, head_dim, d_state, p_blocks,
    stride_xt, stride_xh, stride_xp, stride_Bt, stride_Bg, stride_Bn, stride_Ct, stride_Cg, stride_Cn,
    stride_yt, stride_yh, stride_bc, stride_bh, stride_bp, stride_ch,
    CHUNK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_D: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Each program walks items (chunk, BLOCK_Q-token block of it, head, block of head_dim) of the
    step's chunks, so the grid depends on the device's size only: an item's outputs are the
    entering state read out through C and decayed, plus C . B^T masked by the decays applied to
    dt x within the chunk, plus D x."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, BLOCK_Q)
    n_mask = offs_n < d_state
    q_blocks: tl.constexpr = CHUNK // BLOCK_Q
    items = _chunks_before(cu_ptr, num_rows, CHUNK, BLOCK_R) * q_blocks * num_heads * p_blocks
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        offs_p = (item % p_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
        head = (item // p_blocks) % num_heads
        q_block = (item // (p_blocks * num_heads)) % q_blocks
        chunk = item // (p_blocks * num_heads * q_blocks)
        c_start = tl.load(table_ptr + chunk * 2)
        c_end = tl.load(table_ptr + chunk * 2 + 1)
        q0 = c_start + q_block * BLOCK_Q
        if q0 < c_end:
            p_mask = offs_p < head_dim
            group = head // heads_per_group
            offs_q = q0 + offs_i
            q_mask = offs_q < c_end
            q64 = offs_q.to(tl.int64)
            cum_q = tl.load(cum_ptr + head * stride_ch + q64, mask=q_mask, other=0.0)
            Cq = tl.load(C_ptr + group * stride_Cg + q64[:, None] * stride_Ct + offs_n[None, :] * stride_Cn,
                         mask=q_mask[:, None] & n_mask[None, :], other=0.0).to(DOT_DTYPE)
            # The entering state, decayed to each token and read out through C.
            s_in = tl.load(buf_ptr + chunk.to(tl.int64) * stride_bc + head * stride_bh + offs_p[:, None] * stride_bp
                           + offs_n[None, :], mask=p_mask[:, None] & n_mask[None, :], other=0.0)
            y = tl.dot(Cq, tl.trans(s_in.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * tl.exp(cum_q)[:, None]
            # Within the chunk: y_i += sum_{j <= i} exp(cum_i - cum_j) (C_i . B_j) dt_j x_j.
            for k0 in range(c_start, q0 + BLOCK_Q, BLOCK_Q):
                offs_k = k0 + offs_i
                k_mask = offs_k < c_end
                k64 = offs_k.to(tl.int64)
                cum_k = tl.load(cum_ptr + head * stride_ch + k64, mask=k_mask, other=0.0)
                dt_k = tl.load(steps_ptr + head * stride_ch + k64, mask=k_mask, other=0.0)
                Bk = tl.load(B_ptr + group * stride_Bg + k64[:, None] * stride_Bt + offs_n[None, :] * stride_Bn,
                             mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                xk = tl.load(x_ptr + head * stride_xh + k64[:, None] * stride_xt + offs_p[None, :] * stride_xp,
                             mask=k_mask[:, None] & p_mask[None, :], other=0.0)
                # C . B in the inputs' dtype: 16-bit products are exact in the fp32 accumulator.
                scores = tl.dot(Cq, tl.trans(Bk.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
                causal = offs_q[:, None] >= offs_k[None, :]
                scores *= tl.exp(tl.where(causal, cum_q[:, None] - cum_k[None, :], float("-inf")))
                y += tl.dot((scores * dt_k[None, :]).to(DOT_DTYPE), xk.to(DOT_DTYPE), input_precision=DOT_PRECISION)
            if HAS_D:
                xq = tl.load(x_ptr + head * stride_xh + q64[:, None] * stride_xt + offs_p[None, :] * stride_xp,
                             mask=q_mask[:, None] & p_mask[None, :], other=0.0).to(tl.float32)
                y += tl.load(D_ptr + head).to(tl.float32) * xq
            tl.store(y_ptr + head * stride_yh + q64[:, None] * stride_yt + offs_p[None, :], y,
                     mask=q_mask[:, None] & p_mask[None, :])


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
    Smaller tiles for fp32 inputs (exact-fp32 matmuls need far more registers)."""
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
    wide = x.dtype == torch.float32
    chunk = CHUNK
    block_t, block_p, state_warps, state_stages = WIDE_TILE if wide else STATE_TILE
    block_q, out_p, out_warps, out_stages = WIDE_TILE if wide else OUT_TILE
    if chunk % block_t or chunk % block_q:
        raise ValueError(f"the scan's chunk ({chunk}) must be a multiple of {block_t} and {block_q} tokens")
    block_p, out_p = (max(16, min(b, triton.next_power_of_2(p))) for b in (block_p, out_p))
    block_n = max(16, triton.next_power_of_2(n))
    # Rows of two or more tokens, each with one partial chunk at most.
    max_chunks = triton.cdiv(T, chunk) + min(R, T // 2)
    buf = torch.empty(max_chunks, h, p, n, dtype=torch.float32 if wide else B.dtype, device=x.device)
    table = torch.empty(max_chunks, 2, dtype=torch.int32, device=x.device)
    cum, steps = torch.empty(2, h, T, dtype=torch.float32, device=x.device)
    cu, slots = cu_query_lens.contiguous(), slots.contiguous()
    lo, hi = dt_limit if dt_limit is not None else (0.0, 0.0)
    dots = dot_args(_ssd_chunk_out_kernel, B.dtype)  # 16-bit operands, fp32 accumulators (fp32 inputs: exact fp32)
    _ssd_state_kernel[(R, h, triton.cdiv(p, block_p))](
        x, dt, x if dt_bias is None else dt_bias, A, B, C, x if D is None else D, ssm_pool, y, buf, cum, steps, table,
        slots, has_initial_state.contiguous().view(torch.uint8), cu, h // g, p, n, float(lo), float(hi),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *ssm_pool.stride(), y.stride(0), y.stride(1),
        *buf.stride()[:3], cum.stride(0),
        CHUNK=chunk, BLOCK_T=block_t, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_R=ROW_BLOCK, HAS_D=D is not None,
        **dots, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        HAS_DT_LIMIT=dt_limit is not None, A_IS_LOG=A_is_log, num_warps=state_warps, num_stages=state_stages,
    )
    p_blocks = triton.cdiv(p, out_p)
    programs = min(max_chunks * (chunk // block_q) * h * p_blocks, OUT_PROGRAMS_PER_SM * num_compute_units(x.device))
    _ssd_chunk_out_kernel[(programs,)](
        x, B, C, x if D is None else D, y, buf, cum, steps, table, cu, R, h, h // g, p, n, p_blocks,
        *x.stride(), *B.stride(), *C.stride(), y.stride(0), y.stride(1), *buf.stride()[:3], cum.stride(0),
        CHUNK=chunk, BLOCK_Q=block_q, BLOCK_P=out_p, BLOCK_N=block_n, BLOCK_R=ROW_BLOCK, HAS_D=D is not None,
        **dots, num_warps=out_warps, num_stages=out_stages,
    )
    return y
