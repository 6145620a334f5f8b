"""The sampler's Gumbel noise in Triton: each (row key, token id) hashed to a 24-bit uniform
``u`` (``sample_keys`` / ``sampling.uniform_noise`` in torch) and ``g = -log(-log(u))`` with
libdevice's logs, which the reference's tokens depend on bit for bit.

Those two exact logs are most of a draw's arithmetic (it computes more than it reads), yet a
row's draw only needs the exact score of the elements that could be its argmax. So a
draw first scores every element with ``fast``: the hardware's approximate log (``lg2.approx``)
and, where ``u`` is near 1 and that log loses its relative precision, the series of
``-log(1 - v)``; ``g`` depends on the 24 bits alone, so ``fast_error`` measures the largest
difference from the exact ``g`` over all 2**24 of them (tests hold it under ``G_ERR``). An
element whose fast score is more than ``near_margin`` below the best fast score cannot be the
exact argmax, nor tie with it; only the few others get the exact score."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_sampling_common import EXACT_MATH, fast_log, log_

G_ERR = tl.constexpr(1e-4)  # bound on |fast - exact| over every u: 2.1e-6 on an H100 (a GPU test holds <= G_ERR / 4)


@triton.jit
def mix32(x):
    x = (x ^ (x >> 16)) * 0x7FEB352D
    x = (x ^ (x >> 15)) * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def row_key(seed, position):
    """sampling.row_keys for one row (int64 seed and position)."""
    h = mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9)
    h = mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    return mix32(h ^ (position & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def uniform(rkey, idx):
    tok = mix32(idx.to(tl.uint32) * 0x27D4EB2F)
    bits = mix32(rkey ^ tok) >> 8
    return _uniform_of_bits(bits)


@triton.jit
def _uniform_of_bits(bits):
    return (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def exact(u, EXACT: tl.constexpr):
    return -log_(-log_(u, EXACT), EXACT)


@triton.jit
def fast(u, EXACT: tl.constexpr):
    """``exact`` within G_ERR: -log(u) from the approximate log, or for u > 1 - 2**-5 (where the
    approximate log's absolute error would swamp it) from -log(1 - v) = v + v^2/2 + v^3/3 + v^4/4
    (relative error < v^4 / 5), v = 1 - u exact in float32."""
    v = 1.0 - u
    series = v * (1.0 + v * (0.5 + v * (0.33333334 + v * 0.25)))
    a = tl.where(v < 0.03125, series, -fast_log(u, EXACT))
    return -fast_log(a, EXACT)


@triton.jit
def near_margin(best):
    """How far below the best fast score ``best`` an element's fast score may be and still be the
    exact argmax or tie with it: each fast score is within G_ERR of the exact g plus the rounding
    of adding it to s (2**-24 of the sum's size, twice, taken generously)."""
    return 2.0 * G_ERR + tl.abs(best) * (1.0 / 1048576.0)


@triton.jit
def _error_kernel(out_ptr, BLOCK: tl.constexpr):
    bits = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = _uniform_of_bits(bits.to(tl.uint32))
    f = fast(u, True)
    e = exact(u, True)
    err = tl.where(f == e, 0.0, tl.abs(f - e))  # u rounded to 1 (the top bits): both +inf
    tl.store(out_ptr + tl.program_id(0), tl.max(tl.where(err == err, err, float("inf")), axis=0))


def fast_error(device: torch.device | str = "cuda") -> float:
    """max |fast - exact| over all 2**24 uniforms (CUDA: the kernels' own logs); equal infinities
    count as 0 (u rounds to 1.0 at the largest bits: g = +inf both ways, which the draw scores exactly)."""
    block = 4096
    out = torch.empty((1 << 24) // block, dtype=torch.float32, device=device)
    _error_kernel[(out.numel(),)](out, BLOCK=block, enable_fp_fusion=False)
    return float(out.max())


@triton.jit
def _noise_kernel(seed_ptr, pos_ptr, out_ptr, V, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = uniform(row_key(tl.load(seed_ptr), tl.load(pos_ptr)), idx)
    tl.store(out_ptr + idx, exact(u, EXACT), mask=idx < V)


def exact_noise(seed: int, position: int, vocab: int, device: torch.device | str) -> torch.Tensor:
    """[vocab] float32: one row's exact noise as the draw adds it (tests build near-ties from it)."""
    out = torch.empty(vocab, dtype=torch.float32, device=device)
    args = [torch.tensor([v], dtype=torch.int64, device=device) for v in (seed, position)]
    _noise_kernel[(triton.cdiv(vocab, 1024),)](*args, out, vocab, EXACT=EXACT_MATH, BLOCK=1024, enable_fp_fusion=False)
    return out
