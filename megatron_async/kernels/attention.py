"""Attention backend interface: every attention layer calls ``attend`` and nothing else."""
from __future__ import annotations

import torch

from megatron_async.config import AttentionBackend
from megatron_async.forward_batch import AttentionMetadata
from megatron_async.kernels import attention_torch


def attend(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    batch_invariant: bool = False,
    backend: AttentionBackend = AttentionBackend.TORCH,
    kv_scale: torch.Tensor | None = None,
    quantize: bool = False,
    flashinfer_rows: bool = False,
) -> torch.Tensor:
    """Append this step's k/v ([T, KVH, D]) to the paged cache, then attend q ([T, H, D]).
    k and v None: already stored (``fused_ops.rope_qk`` with the cache).

    ``backend``: the model's (``KernelBackends.attention``; TORCH or TRITON). ``batch_invariant``:
    the Triton fixed-order path whatever the backend (see ``attention_triton.attend``).
    ``kv_scale`` [2, KVH] float32: the layer's key / value scales when the cache is e4m3
    (``kv_cache_fp8``). Returns [T, H, D] in q's dtype. ``quantize``: the Triton kernels may return
    the output's [T, H * D] rows quantized for an FP8 o projection instead (``QuantizedRows``; only
    outside batch-invariant mode, with head_dim 128); the torch path returns a tensor.
    ``flashinfer_rows``: the Triton path may run a long-tile step's long rows on FlashInfer's FA3
    kernel (``KernelBackends.flashinfer_prefill``)."""
    if batch_invariant or backend == AttentionBackend.TRITON:
        from megatron_async.kernels import attention_triton

        return attention_triton.attend(q, k, v, kv_cache, meta, scale, fixed_order=batch_invariant, kv_scale=kv_scale,
                                       quantize=quantize and not batch_invariant, flashinfer_rows=flashinfer_rows)
    if k is not None:
        attention_torch.write_kv(kv_cache, k, v, meta.slot_mapping[: meta.num_tokens], kv_scale)
    if meta.is_decode_only:
        return attention_torch.decode_attention(q, kv_cache, meta, scale, kv_scale)
    return attention_torch.mixed_attention(q, k, v, kv_cache, meta, scale, kv_scale)
