"""Attention backend interface: every attention layer calls ``attend`` and nothing else."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_async.config import AttentionBackend
from megatron_async.inference.contexts.metadata import AttentionMetadata
from megatron_async.kernels import attention_torch

_backend: AttentionBackend = AttentionBackend.TORCH


@dataclass
class DecodeRope:
    """What the decode kernel needs to do the rope kernel's work itself: the rows' raw new k / v
    ([R, KVH, D] views of the qkv projection), cos / sin [R, D / 2] at the rows' positions (full
    rotary only), and Qwen3's per-head norm weights (or None). The new k / v are stored at
    ``meta.slot_mapping`` (negative slots skipped)."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    eps: float

    def fits(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        R, _, D = q.shape
        tensors = [self.k, self.v, self.cos, self.sin] + ([self.q_norm_weight, self.k_norm_weight]
                                                          if self.q_norm_weight is not None else [])
        return (D >= 16 and D & (D - 1) == 0 and self.k.shape == self.v.shape == (R, kv_cache.shape[3], D)
                and self.cos.shape == self.sin.shape == (R, D // 2) and self.cos.stride() == self.sin.stride()
                and (self.k_norm_weight is None) == (self.q_norm_weight is None)
                and all(t.dtype == q.dtype and t.stride(-1) == 1 for t in tensors) and kv_cache.dtype == q.dtype)


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
    return attention_torch.paged_attention(q, kv_cache, meta, scale)


def fuses_decode_rope(q: torch.Tensor, meta: AttentionMetadata, batch_invariant: bool) -> bool:
    """Whether a decode-only step's rotary embedding (and per-head norm) runs inside the decode
    attention kernel (``attend_decode_rope``) instead of a kernel of its own."""
    d = q.shape[-1]  # the caller checked fused_ops.use_fused (CUDA unless a test routes CPU there)
    return meta.is_decode_only and not batch_invariant and _backend == AttentionBackend.TRITON and d >= 16 \
        and d & (d - 1) == 0


def attend_decode_rope(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                       rope: DecodeRope) -> torch.Tensor:
    """Decode attention from the projection's raw q / k / v (``rope``): rotary (and norm) of q and of the new k, the new k /
    v stored in the cache, and attention, in one kernel. Only where ``fuses_decode_rope``."""
    from megatron_async.kernels.triton_decode_attention import decode_attention

    return decode_attention(q, kv_cache, meta, scale, rope=rope)
