"""Triton kernels for the causal conv1d of a mixed step's Mamba2 rows on the packed token layout
(no padded [rows, longest row] copy), each row reading its initial state from its slot in the
pool (zeros when it starts fresh) and leaving its final state there in place. Semantics of
``conv1d_torch.causal_conv1d`` applied row by row (the SSD scan: ``triton_ssd_varlen``).

Everything a kernel needs about the rows comes from device tensors of the step snapshot
(``cu_query_lens``, ``state_slots``, ``has_initial_state``): grids depend only
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


@triton.jit(do_not_specialize=["num_tokens"])  # one build for every (padded) token count
def _conv_out_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, num_tokens, channels, stride_xt, stride_wc, stride_wk, stride_ot,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Every token through the packed layout as if it were one sequence (taps before token 0 are
    zeros): right for all but each row's first K - 1 tokens, which ``_conv_rows_kernel`` then
    rewrites from the row's state. Row-agnostic, so no program waits on the rows' tables."""
    t0 = tl.program_id(0) * BLOCK_T
    offs_i = tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask = t0 + offs_i < num_tokens
    c_mask = offs_c < channels
    x_tile = x_ptr + t0.to(tl.int64) * stride_xt + offs_c[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        src = offs_i + (k - (K - 1))
        xv = tl.load(x_tile + src[:, None] * stride_xt, mask=((t0 + src >= 0) & t_mask)[:, None] & c_mask[None, :],
                     other=0.0)
        w = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=c_mask, other=0.0).to(tl.float32)
        acc += w[None, :] * xv.to(tl.float32)
    out = acc / (1.0 + tl.exp(-acc))  # SiLU
    out_ptrs = out_ptr + t0.to(tl.int64) * stride_ot + offs_i[:, None] * stride_ot + offs_c[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])


@triton.jit
def _ext_entry(x_ptr, s_row, start, e, offs_c, channels, stride_xt, stride_sk, init, x_ok, K: tl.constexpr):
    """ext[e] of a row's ext = [old state (K - 1), its tokens], in x's dtype: state entries read as
    zeros for a fresh row, token entries as zeros where ``x_ok`` is False."""
    from_x = tl.load(x_ptr + (start + e - (K - 1)).to(tl.int64) * stride_xt + offs_c,
                     mask=offs_c < tl.where((e >= K - 1) & x_ok, channels, 0), other=0.0)
    from_state = tl.load(s_row + e * stride_sk, mask=offs_c < tl.where((e < K - 1) & init, channels, 0), other=0.0)
    return from_x + from_state.to(x_ptr.dtype.element_ty)


@triton.jit
def _conv_rows_kernel(
    x_ptr, w_ptr, bias_ptr, pool_ptr, out_ptr, slots_ptr, has_init_ptr, cu_ptr,
    channels, stride_xt, stride_wc, stride_wk, stride_sb, stride_sc, stride_sk, stride_ot,
    K: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Row r's first K - 1 outputs, whose taps reach into its old state (zeros when it starts
    fresh), then its new state: ext[len .. len + K - 2] of ext = [old state (K - 1), the row's
    tokens], its last K - 1 inputs. Each element is read before it is written and by the same
    thread (state entry j is written after entries >= j were read, j rising): in place is safe."""
    row = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(cu_ptr + row)
    length = tl.load(cu_ptr + row + 1) - start
    slot = tl.load(slots_ptr + row).to(tl.int64)
    init = (tl.load(has_init_ptr + row) != 0) & (slot >= 0)
    s_row = pool_ptr + slot * stride_sb + offs_c * stride_sc
    w_row = w_ptr + offs_c * stride_wc
    bias = tl.load(bias_ptr + offs_c, mask=offs_c < channels, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1):  # output j sums its taps in the order _conv_out_kernel does
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            acc += bias
        for k in tl.static_range(K):  # tap k is ext[j + k]
            ext = _ext_entry(x_ptr, s_row, start, j + k, offs_c, channels, stride_xt, stride_sk, init, j < length, K)
            w = tl.load(w_row + k * stride_wk, mask=offs_c < channels, other=0.0).to(tl.float32)
            acc += w * ext.to(tl.float32)
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (start + j).to(tl.int64) * stride_ot + offs_c, out.to(out_ptr.dtype.element_ty),
                 mask=offs_c < tl.where(j < length, channels, 0))
    c_mask = offs_c < tl.where(slot >= 0, channels, 0)  # a skipped row keeps no state
    for j in tl.static_range(K - 1):
        val = _ext_entry(x_ptr, s_row, start, length + j, offs_c, channels, stride_xt, stride_sk, init, True, K)
        tl.store(s_row + j * stride_sk, val.to(pool_ptr.dtype.element_ty), mask=c_mask)


CONV_TILE = (16, 256, 4)
"""(tokens, channels, warps) of a ``_conv_out_kernel`` program. The hybrid's 8,192-token mixed step
(4,096 channels of a 6,176-wide projection, one H100; with ``_conv_rows_kernel``): 68.2 us, 69.5-76.2
for the other 8 settings tried (8-64 tokens x 64-256 channels, 2-8 warps), 83.8 at 64 x 128 on 8; 16.3
at 1,031 tokens of short rows. The same bits at every tile (each output's taps are summed in one order)."""


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
    slots: torch.Tensor, has_initial_state: torch.Tensor, cu_query_lens: torch.Tensor,
) -> torch.Tensor:
    """Packed rows x [T, c] (row r = tokens cu[r] : cu[r + 1]), weight
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
    if x.stride(1) != 1:
        raise ValueError("the conv's channels must be contiguous")
    tile_t, tile_c, warps = CONV_TILE
    tile_c = min(tile_c, triton.next_power_of_2(c))
    b = x if bias is None else bias
    _conv_out_kernel[(triton.cdiv(T, tile_t), triton.cdiv(c, tile_c))](
        x, weight, b, out, T, c, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        K=k, BLOCK_T=tile_t, BLOCK_C=tile_c, HAS_BIAS=bias is not None, num_warps=warps,
    )
    _conv_rows_kernel[(R, triton.cdiv(c, block_c))](
        x, weight, b, conv_pool, out, slots, has_init, cu, c, x.stride(0), weight.stride(0), weight.stride(1),
        *conv_pool.stride(), out.stride(0), K=k, BLOCK_C=block_c, HAS_BIAS=bias is not None,
    )
    return out
