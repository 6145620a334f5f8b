"""The expert-parallel exchange's packing in one kernel each way.

Before the all-gather, a rank's tokens and their routing travel as ONE tensor (one collective
for both): row r = [x[r] | ids[r] (int32 bits) | weights[r] (float32 bits)], in x's dtype, padded
to the agreed token count with zero tokens routed to expert E (none). torch needs three pads and
a concatenation for that (four launches), and after the gather two copies and a subtraction to
get the ids local to this rank and the weights back; here it is one launch on each side, with
the same bytes (``RoutedExperts._exchange`` keeps the torch code for the CPU)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pack_kernel(x_ptr, ids_ptr, w_ptr, out_ptr, out32_ptr, n, stride_x, stride_out, stride_out32,
                 H: tl.constexpr, K: tl.constexpr, ROUTE_COL: tl.constexpr, NONE: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_cols = tl.where(row < n, H, 0)  # padding rows read nothing (zeros)
    k_cols = tl.where(row < n, K, 0)
    offs = tl.arange(0, BLOCK_H)
    for h0 in tl.static_range(0, H, BLOCK_H):
        cols = h0 + offs
        val = tl.load(x_ptr + row * stride_x + cols, mask=cols < x_cols, other=0.0)
        tl.store(out_ptr + row * stride_out + cols, val, mask=cols < H)
    slots = tl.arange(0, BLOCK_K)
    sm = slots < K
    ids = tl.load(ids_ptr + row * K + slots, mask=slots < k_cols, other=NONE)
    w = tl.load(w_ptr + row * K + slots, mask=slots < k_cols, other=0.0)
    route = out32_ptr + row * stride_out32 + ROUTE_COL
    tl.store(route + slots, ids, mask=sm)
    tl.store(route + K + slots, w.to(tl.int32, bitcast=True), mask=sm)


@triton.jit
def _unpack_kernel(in32_ptr, ids_ptr, w_ptr, stride_in32, first_expert, K: tl.constexpr, ROUTE_COL: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    sm = slots < K
    route = in32_ptr + row * stride_in32 + ROUTE_COL
    ids = tl.load(route + slots, mask=sm, other=0)
    bits = tl.load(route + K + slots, mask=sm, other=0)
    tl.store(ids_ptr + row * K + slots, ids - first_expert, mask=sm)  # other ranks' experts fall outside
    tl.store(w_ptr + row * K + slots, bits.to(tl.float32, bitcast=True), mask=sm)


def _route_col(h: int, dtype: torch.dtype) -> int:
    nbytes = h * torch.empty((), dtype=dtype).element_size()
    if nbytes % 4:
        raise ValueError(f"ep_pack: a row of {h} {dtype} values is not a whole number of int32 words")
    return nbytes // 4


def ep_pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rows: int, num_experts: int) -> torch.Tensor:
    """x [n, h], ids [n, k] int32, weights [n, k] float32 -> [rows, h + routing lanes] in x's
    dtype: the tokens, then the ids' and the weights' bits; rows n..rows-1 zero, routed to
    ``num_experts`` (no expert)."""
    n, h = x.shape
    k = ids.shape[1]
    if ids.dtype != torch.int32 or weights.dtype != torch.float32 or rows < n or x.stride(1) != 1:
        raise ValueError("ep_pack: needs int32 ids, float32 weights, rows >= tokens, unit last stride")
    col = _route_col(h, x.dtype)
    lanes = 8 * k // x.element_size()  # int32 ids + float32 weights, in x's dtype
    out = torch.empty((rows, h + lanes), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    out32 = out.view(torch.int32)
    _pack_kernel[(rows,)](x, ids.contiguous(), weights.contiguous(), out, out32, n, x.stride(0), out.stride(0),
                          out32.stride(0), H=h, K=k, ROUTE_COL=col, NONE=num_experts,
                          BLOCK_H=min(2048, triton.next_power_of_2(h)), BLOCK_K=max(2, triton.next_power_of_2(k)),
                          num_warps=4)
    return out


def ep_unpack(packed: torch.Tensor, h: int, k: int, first_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered ``ep_pack`` rows -> (ids local to this rank [R, k] int32, weights [R, k]
    float32); the tokens are ``packed[:, :h]`` (a strided view, no copy)."""
    rows = packed.shape[0]
    ids = torch.empty((rows, k), dtype=torch.int32, device=packed.device)
    weights = torch.empty((rows, k), dtype=torch.float32, device=packed.device)
    if rows:
        in32 = packed.view(torch.int32)
        _unpack_kernel[(rows,)](in32, ids, weights, in32.stride(0), first_expert, K=k,
                                ROUTE_COL=_route_col(h, packed.dtype), BLOCK_K=max(2, triton.next_power_of_2(k)),
                                num_warps=1)
    return ids, weights
