"""Mixed-step attention in two parts: the step's new tokens among themselves through torch's
varlen flash attention, then each row's cached prefix merged in by a Triton pass.

Measured on an H100 (workload A's mixed steps, 8,192 tokens of 100-1,024-token prompts): the
one paged Triton kernel reaches ~130-170 TFLOP/s, flash attention ~300-380 on the same causal
work. Most of a prefill chunk's attention is among its own tokens, which sit contiguous in the
step's q / k / v, so flash attention takes that part: causal over each row's new tokens, with
its log-sum-exp. ``triton_prefill_attention`` (``merge_prefix``) then walks only the keys
cached before the chunk (continued prompts, the decode rows of a mixed step), starting its
online softmax from flash attention's (output, lse): the result is attention over all of a
row's keys. Rows without a prefix are finished by flash attention alone.

Used on CUDA for fp16 / bf16 steps whose longest row has at least ``MIN_QUERY_LEN`` tokens
(prefill chunks; speculative verify windows and decode steps keep the one-kernel paths), never
in batch-invariant mode (its bits must not depend on how the step is composed). Graph-safe:
``max_query_len`` is a bound of the step's (a mixed graph's bucket), the rest is device data."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_async.inference.contexts.metadata import AttentionMetadata

MIN_QUERY_LEN = 32
"""Steps whose longest row is shorter stay on the one-kernel path (verify windows, short chunks)."""


@dataclass(frozen=True)
class VarlenSupport:
    native_gqa: bool
    """The op takes fewer KV heads than query heads (else KV heads are repeated)."""
    lse_heads_first: bool
    """The log-sum-exp comes back [H, T] (else [T, H])."""


@functools.lru_cache(maxsize=None)
def varlen_support(device: torch.device) -> VarlenSupport | None:
    """Whether torch's varlen flash attention runs here, and its conventions (probed once on
    tiny tensors: no host sync, safe inside a capture)."""
    if device.type != "cuda":
        return None
    try:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn
    except ImportError:
        return None
    T, H, D = 3, 4, 64
    q = torch.zeros(T, H, D, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, T], device=device, dtype=torch.int32)
    for kv_heads in (H // 2, H):
        kv = torch.zeros(T, kv_heads, D, device=device, dtype=torch.bfloat16)
        try:
            _, lse = varlen_attn(q, kv, kv, cu, cu, T, T, return_aux=AuxRequest(lse=True), window_size=(-1, 0))
        except (RuntimeError, TypeError, ValueError):
            continue
        if tuple(lse.shape) not in ((H, T), (T, H)):
            return None
        return VarlenSupport(native_gqa=kv_heads < H, lse_heads_first=tuple(lse.shape) == (H, T))
    return None


def applies(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether a (non batch-invariant) Triton-backend step takes the two-part path."""
    return (not meta.is_decode_only and meta.max_query_len >= MIN_QUERY_LEN and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16) and varlen_support(q.device) is not None)


def new_token_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Causal attention of each row's new tokens among themselves: (out [T, H, D], lse float32
    (natural log), lse's (token, head) strides)."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    support = varlen_support(q.device)
    group = q.shape[1] // k.shape[1]
    if group > 1 and not support.native_gqa:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cu, n = meta.cu_query_lens, meta.max_query_len
    out, lse = varlen_attn(q, k, v, cu, cu, n, n, return_aux=AuxRequest(lse=True), scale=scale, window_size=(-1, 0))
    strides = (lse.stride(1), lse.stride(0)) if support.lse_heads_first else (lse.stride(0), lse.stride(1))
    return out, lse, strides
