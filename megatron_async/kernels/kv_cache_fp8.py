"""The FP8 (e4m3) paged KV cache, torch side: quantizing keys / values into the pool, reading blocks
back, and the byte moves the pool needs.

Layout unchanged: one layer's pool is [2, num_blocks, block_size, num_kv_heads, head_dim], in
float8_e4m3fn (half of bf16's bytes). Each attention layer owns ``kv_scale`` [2, num_kv_heads]
float32 (row 0 keys, row 1 values): stored = e4m3(x / scale) (round to nearest even, saturating at
+-448), read = stored * scale. Scales are powers of two, 1.0, and fixed for the life of the model:
a cached block's bytes mean the same to every later reader (prefix caching, chunked prefill,
eviction and recompute, speculative verify, suspend / resume). Not calibrated from a first
prefill: that would make every later token depend on which request came first (and a restart
or another rank would calibrate differently). Post-RoPE K and V of the models measured sit well
inside e4m3's range at 1.0 (SmolLM2-135M: |K| <= 24, |V| <= 10 on English text), and scales
calibrated with 4x headroom moved its perplexity by 0.02 of the 0.8 that FP8 costs there.

The Triton kernels never build a dequantized tile: e4m3 -> bf16 / f16 is exact, so the key scale is
folded into the softmax scale and the value scale multiplies the normalised output once (with
powers of two both folds are exact). The torch paths dequantize the blocks they gather.

Every byte move of a pool goes through a uint8 view (``byte_view``): torch has no ``index_copy_``
for float8 on CPU."""
from __future__ import annotations

import torch

FP8_KV = torch.float8_e4m3fn
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8_KV, "fp8_e4m3": FP8_KV}
"""``InferenceConfig.kv_cache_dtype`` values -> the pool's dtype (None: the model's dtype)."""


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_KV


def pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for ``InferenceConfig.kv_cache_dtype``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as uint8 when its elements are one byte (index_copy_ / index_select on e4m3), else ``t``."""
    return t.view(torch.uint8) if t.dtype == FP8_KV else t


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, KVH, D] -> e4m3 with one power-of-two scale per KV head (the division is exact)."""
    return (x.float() / scale.view(1, -1, 1)).clamp(-448.0, 448.0).to(FP8_KV)


def write_kv_fp8(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: torch.Tensor) -> None:
    """``attention_torch.write_kv`` for an e4m3 pool (byte copies through a uint8 view)."""
    _, nb, bs, kvh, d = kv_cache.shape
    flat = kv_cache.view(torch.uint8).view(2, nb * bs, kvh, d)
    flat[0].index_copy_(0, slot_mapping, quantize_kv(k, kv_scale[0]).view(torch.uint8))
    flat[1].index_copy_(0, slot_mapping, quantize_kv(v, kv_scale[1]).view(torch.uint8))


def gather(kv_cache: torch.Tensor, blocks: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """Blocks ``blocks`` of a pool, [2, n, block_size, KVH, D]: in the pool's dtype, or float32
    dequantized when the pool is e4m3."""
    if not is_fp8(kv_cache):
        return kv_cache.index_select(1, blocks)
    raw = kv_cache.view(torch.uint8).index_select(1, blocks).view(FP8_KV)
    return raw.float() * kv_scale.view(2, 1, 1, -1, 1)


def round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, KVH, D] as an e4m3 pool gives it back (float32): the torch path's fresh-prompt shortcut
    (attention over this step's own k / v) must use this, or a prompt would attend differently with
    and without a prefix-cache hit."""
    return quantize_kv(x, scale).float() * scale.view(1, -1, 1)
