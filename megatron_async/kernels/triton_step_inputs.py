"""A step's input token ids in one kernel: each token's id comes from the snapshot, or (when
the host did not know it yet) from the samples of the launch in flight. The torch form
(``torch.where(prev >= 0, samples[prev.clamp(min=0)], ids)``) takes four kernels."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _resolve_ids_kernel(prev_ptr, samples_ptr, ids_ptr, out_ptr, T, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < T
    prev = tl.load(prev_ptr + offs, mask=mask, other=-1)
    known = tl.load(ids_ptr + offs, mask=mask, other=0)
    sampled = tl.load(samples_ptr + tl.maximum(prev, 0), mask=mask & (prev >= 0), other=0)
    tl.store(out_ptr + offs, tl.where(prev >= 0, sampled, known), mask=mask)


def resolve_input_ids(prev: torch.Tensor, samples: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """prev [T] (index into ``samples``, or -1: the id is ``ids``' entry), samples [S], ids [T],
    all int64 and contiguous -> [T] int64 ids."""
    if not (prev.shape == ids.shape and prev.dim() == 1 and prev.dtype == samples.dtype == ids.dtype == torch.int64
            and prev.is_contiguous() and samples.is_contiguous() and ids.is_contiguous()):
        raise ValueError(f"resolve_input_ids: prev {tuple(prev.shape)} {prev.dtype}, samples {tuple(samples.shape)} "
                         f"{samples.dtype}, ids {tuple(ids.shape)} {ids.dtype}")
    out = torch.empty_like(ids)
    if out.numel():
        _resolve_ids_kernel[(triton.cdiv(out.numel(), _BLOCK),)](prev, samples, ids, out, out.numel(), BLOCK=_BLOCK)
    return out
