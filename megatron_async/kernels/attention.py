"""Attention backend interface: every attention layer calls ``attend`` and nothing else."""
from __future__ import annotations

import torch

from megatron_async.config import AttentionBackend
from megatron_async.inference.contexts.metadata import AttentionMetadata
from megatron_async.kernels import attention_torch

_backend: AttentionBackend = AttentionBackend.TORCH


def set_attention_backend(backend: AttentionBackend | str, device: torch.device | str) -> AttentionBackend:
    """Pick the process-wide attention backend; AUTO means Triton on CUDA when importable."""
    global _backend
    backend = AttentionBackend(backend)
    if backend == AttentionBackend.AUTO:
        backend = AttentionBackend.TORCH
        if torch.device(device).type == "cuda":
            try:
                import triton  # noqa: F401

                from megatron_async.kernels import attention_triton  # noqa: F401

                backend = AttentionBackend.TRITON
            except ImportError:
                pass
    _backend = backend
    return backend


def get_attention_backend() -> AttentionBackend:
    return _backend


def attend(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Append this step's k/v ([T, KVH, D]) to the paged cache, then attend q ([T, H, D]).
    k and v None: already stored (``fused_ops.rope_qk`` with the cache).

    ``batch_invariant``: the Triton fixed-order path whatever the backend (see
    ``attention_triton.attend``). Returns [T, H, D] in q's dtype."""
    if batch_invariant or _backend == AttentionBackend.TRITON:
        from megatron_async.kernels import attention_triton

        return attention_triton.attend(q, k, v, kv_cache, meta, scale, fixed_order=batch_invariant)
    if k is not None:
        attention_torch.write_kv(kv_cache, k, v, meta.slot_mapping[: meta.num_tokens])
    if meta.is_decode_only:
        return attention_torch.decode_attention(q, kv_cache, meta, scale)
    return attention_torch.mixed_attention(q, k, v, kv_cache, meta, scale)
