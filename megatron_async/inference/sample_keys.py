"""A sampled row's random key: a pure function of (request seed, position), shared by the
sampler (text_generation_controllers/sampling.py; kernels/triton_sampling.py repeats it in
Triton) and the oracle drafter's corruption draws."""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply) on int64 tensors holding values < 2**32.

    Products may wrap past int64; masking keeps the correct low 32 bits."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & M32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & M32
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[R] int64 seeds and positions -> [R] 32-bit keys."""
    h = mix32((seed & M32) ^ 0x9E3779B9)
    h = mix32(h ^ ((seed >> 32) & M32))
    return mix32(h ^ (position & M32))
