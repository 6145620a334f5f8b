"""Triton attention backend: same contract as ``attention.attend`` with the torch backend.

Decode-only steps use the split-K decode kernel; any step with a multi-token row uses
the varlen prefill kernel, which also serves that step's decode rows. Nothing here reads
device data on the host (no syncs), and launch grids depend only on tensor shapes and
meta.num_tokens / meta.num_rows, so decode steps can be captured in CUDA graphs with
``meta.max_kv_len`` set to an upper bound (see triton_decode_attention).

Runs on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported), for tests."""
from __future__ import annotations

import torch

from megatron_async.forward_batch import AttentionMetadata
from megatron_async.kernels.triton_decode_attention import decode_attention
from megatron_async.kernels.triton_invariant_attention import invariant_attention
from megatron_async.kernels.triton_kv_append import append_kv
from megatron_async.kernels.triton_prefill_attention import prefill_attention


def attend(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    fixed_order: bool = False,
    kv_scale: torch.Tensor | None = None,
    quantize: bool = False,
    flashinfer_rows: bool = False,
) -> torch.Tensor:
    """Append k/v ([T, KVH, D]; None: already in the cache) at ``meta.slot_mapping[:T]``, then attend q ([T, H, D]) over
    each row's paged KV. Returns [T, H, D] in q's dtype.

    ``fixed_order`` (batch-invariant mode): every row, decode or prefill chunk, goes through
    ``triton_invariant_attention``: splits fixed in absolute key positions, each walked with
    the same masked online-softmax update for every key tile, merged in split order. A
    query's bits then depend only on its position and the K/V it reads back from the cache
    (the new tokens too are read after the append, never from the un-stored k/v), not on the
    step's batch, on how its prompt was chunked, or on decode vs prefill.

    An e4m3 cache: ``kv_scale`` [2, KVH] (keys, values) quantizes the append and is folded into
    the kernels' softmax scale and output. ``quantize`` (D = 128, not with ``fixed_order``): the
    output's [T, H * D] rows quantized for an FP8 o projection by the kernel (``QuantizedRows``).
    ``flashinfer_rows``: a long-tile step's long rows on FlashInfer's FA3 kernel (``prefill_attention``)."""
    if k is not None:  # None: the rope kernel stored them already
        append_kv(kv_cache, k, v, meta.slot_mapping, kv_scale)
    if fixed_order:
        return invariant_attention(q, kv_cache, meta, scale, kv_scale=kv_scale)
    if meta.is_decode_only:
        return decode_attention(q, kv_cache, meta, scale, kv_scale=kv_scale, quantize=quantize)
    return prefill_attention(q, kv_cache, meta, scale, kv_scale=kv_scale, quantize=quantize,
                             flashinfer_rows=flashinfer_rows)
