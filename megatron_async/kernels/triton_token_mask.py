"""Triton kernel of ``token_mask.apply_token_bitmask``: one program per (sample, block of token
ids) reads the sample's bitmask row (when it has one) and writes the masked copy. Reads only
tensors it is given (no host values): CUDA-graph safe."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _mask_kernel(logits_ptr, logits_stride, out_ptr, out_stride, mask_ptr, mask_stride, row_map_ptr, V,
                 BLOCK: tl.constexpr):
    s, c = tl.program_id(0), tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    inside = idx < V
    x = tl.load(logits_ptr + s.to(tl.int64) * logits_stride + idx, mask=inside)
    g = tl.load(row_map_ptr + s)
    if g >= 0:
        words = tl.load(mask_ptr + g.to(tl.int64) * mask_stride + idx // 32, mask=inside, other=-1)
        bit = (words >> (idx % 32)) & 1
        x = tl.where(bit != 0, x, float("-inf"))
    tl.store(out_ptr + s.to(tl.int64) * out_stride + idx, x, mask=inside)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    S, V = logits.shape
    out = torch.empty_like(logits)
    if S:
        _mask_kernel[(S, triton.cdiv(V, BLOCK))](logits, logits.stride(0), out, out.stride(0), bitmask,
                                                 bitmask.stride(0), row_map, V, BLOCK=BLOCK)
    return out
