"""A mixed step's fresh prompt rows on cuDNN's attention, the rest of the step on the Triton kernels.

A fresh row has no cached prefix: its keys are exactly its own tokens, so its attention is a plain
causal attention over contiguous K / V, which torch's ``scaled_dot_product_attention`` runs on
cuDNN's Hopper kernels at 560-640 TFLOP/s where the Triton prefill kernel reaches ~475 (8k tokens,
bf16, head dim 128, one H200; ``python -m benchmarks kernel-times prefill-attention``'s peers). The
host picks the rows (``fresh_rows``: query tokens == KV tokens >= ``FRESH_MIN_QUERY``) and the
Triton kernel's tile schedule skips the same rows by the same rule on the device
(``triton_tile_schedule``), so every row is computed once.

The row's K / V are read back from the paged cache (the rope kernel stored them there) into
contiguous buffers padded with zeros to a multiple of ``BUCKET`` tokens, the queries likewise:
a causal query never sees a later key, so the padding changes no real row's output, and cuDNN
builds one execution plan per bucket instead of one per prompt length. Steps with such rows run
eager (their host loop over rows is no graph's shape); 16-bit caches only."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_async.forward_batch import AttentionMetadata

FRESH_MIN_QUERY = 2048
"""Query tokens from which a fresh row goes to cuDNN: from 2k tokens cuDNN's kernels ran 1.2x the
Triton kernel's (4 x 2k: 461-509 against 376-394 TFLOP/s); shorter rows stay beside the step's
decode rows, whose memory-bound tiles the Triton launch overlaps with theirs."""

BUCKET = 512
"""Rows are padded to a multiple of this many tokens: one cuDNN plan per bucket."""


def fresh_rows(cu_query_lens, kv_lens, min_query: int) -> tuple[tuple[int, int], ...]:
    """(first token, tokens) of each row without a cached prefix and with ``min_query``+ query
    tokens (host arrays of one step: ``cu_query_lens`` [R + 1], ``kv_lens`` [R])."""
    cu = np.asarray(cu_query_lens, dtype=np.int64)
    q = np.diff(cu)
    pick = (q == np.asarray(kv_lens, dtype=np.int64)) & (q >= min_query)
    return tuple((int(cu[r]), int(q[r])) for r in np.flatnonzero(pick))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN's attention can take a 16-bit model's fresh rows on ``device`` (Hopper or newer)."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and torch.backends.cudnn.is_available()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    out = t.new_zeros((length, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def attend_fresh_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      out: torch.Tensor) -> None:
    """Write the causal attention of each of ``meta.fresh_rows`` (q [T, H, D]; its K / V already in
    ``kv_cache`` [2, blocks, block_size, KVH, D] at ``meta.slot_mapping``) into ``out`` [T, H, D].
    cuDNN on CUDA; torch's math backend elsewhere (the tests' CPU runs)."""
    keys, values = kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)  # [slots, KVH, D]
    backend = SDPBackend.CUDNN_ATTENTION if q.is_cuda else SDPBackend.MATH
    for start, length in meta.fresh_rows:
        padded = -(-length // BUCKET) * BUCKET
        slots = meta.slot_mapping[start: start + length]
        k = _padded(keys.index_select(0, slots), padded).transpose(0, 1)[None]
        v = _padded(values.index_select(0, slots), padded).transpose(0, 1)[None]
        rows = _padded(q[start: start + length], padded).transpose(0, 1)[None]
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(rows, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out[start: start + length] = o[0, :, :length].transpose(0, 1)
