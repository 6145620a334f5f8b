"""Stateless per-request sampling: the random draw of a row is a pure function of
(request seed, position of the token being sampled, token id), so a request's tokens never
depend on which other requests share its batch, on admission timing, preemption or
async/serial mode. Sampling is Gumbel-max over the temperature-scaled, top-k / top-p
filtered logits; greedy rows (temperature 0 or top_k 1) take the argmax."""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
GREEDY_TEMPERATURE = 1e-5


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply) on int64 tensors holding values < 2**32.

    Products may wrap past int64; masking keeps the correct low 32 bits."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[R] int64 seeds and positions -> [R] 32-bit keys."""
    h = _mix32((seed & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & _M32))
    return _mix32(h ^ (position & _M32))


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R] keys -> [R, V] float32 uniforms in (0, 1), one per (row, token id)."""
    tok = _mix32(torch.arange(vocab_size, device=keys.device, dtype=torch.int64) * 0x27D4EB2F & _M32)
    bits = _mix32(keys[:, None] ^ tok[None, :]) >> 8  # 24 random bits: exact in float32
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _row_cumsum(x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    if batch_invariant and x.shape[0] == 1:
        # torch on CUDA scans a lone row with one device-wide scan but a batch row by row:
        # scan it beside a copy so a row is always summed the same way.
        return torch.cat([x, x]).cumsum(-1)[:1]
    return x.cumsum(-1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       batch_invariant: bool = False) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus; top_k 0 / top_p 0 = off.
    ``batch_invariant``: a stable sort (tied logits keep id order at any batch size) and a
    cumulative sum that scans a lone row the way it scans a batch."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=batch_invariant)
    V = logits.shape[-1]
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = _row_cumsum(probs, batch_invariant) - probs  # mass strictly above this token
    p = top_p[:, None]
    drop |= (p > 0) & (p < 1) & (before >= p)
    mask = torch.zeros_like(drop).scatter_(-1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    any_random: bool,
    any_filter: bool,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """logits [R, V] float32 -> tokens [R] int64. ``any_random`` / ``any_filter`` are host
    flags (from the requests' params) that skip work no row needs; they never change results.
    Everything here is per row (argmax, elementwise noise, per-row sort / softmax / scan);
    ``batch_invariant`` only closes the two gaps in that (see ``filter_top_k_top_p``)."""
    greedy_tokens = logits.argmax(dim=-1)
    if not any_random:
        return greedy_tokens
    greedy = temperature < GREEDY_TEMPERATURE  # smaller ones overflow logits / t in float32
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if any_filter:
        scaled = filter_top_k_top_p(scaled, top_k, top_p, batch_invariant)
    u = uniform_noise(row_keys(seed, position), logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    drawn = (scaled + gumbel).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, drawn)


def log_probs_of(logits: torch.Tensor, tokens: torch.Tensor, top_n: int, batch_invariant: bool = False):
    """Log-probabilities of the raw (unscaled) distribution: of the sampled tokens [R], and
    the top-n (values [R, n], ids [R, n]) when top_n > 0. ``batch_invariant``: the
    one-program-per-row Triton log-softmax."""
    if batch_invariant:
        from megatron_async.kernels.triton_log_softmax import log_softmax

        lp = log_softmax(logits)
    else:
        lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(-1, tokens[:, None])[:, 0]
    if top_n > 0:
        vals, ids = lp.topk(top_n, dim=-1)
        return chosen, vals, ids
    return chosen, None, None
