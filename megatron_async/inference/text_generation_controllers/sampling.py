"""Stateless per-request sampling, the reference definition (pure torch, CPU and CUDA).

A row's draw is a pure function of (request seed, position of the token being sampled,
token id), so a request's tokens never depend on which other requests share its batch, on
admission timing, preemption or async/serial mode. The definition, per row:

1. ``s = logits * inv_t`` with ``inv_t = 1 / temperature`` (one float32 rounding, computed
   once per row); greedy rows (temperature < 1e-5 or top_k 1) take ``argmax(logits)``.
2. The kept set is an upper set of ``s``, tie-inclusive:
   - min-p: ``exp(s - max s) >= min_p`` (vLLM's ``p >= min_p * p_max``);
   - top-k: ``s >= `` the k-th largest ``s``;
   - top-p over the min-p / top-k survivors: ``s >= tau``, tau the largest value whose
     mass at or above it reaches ``top_p`` of the survivors' mass. Mass is measured in
     fixed point: a token weighs ``floor(2**32 * exp(s - max s))`` (float32), and weights
     are summed in float64, which is exact (<= 2**50) in any order, so the boundary never
     depends on summation order. Tokens below 2**-32 of the top token weigh nothing.
3. Gumbel-max: ``argmax over kept of s + g``, ``g = -log(-log(u))`` with ``u`` from a
   32-bit hash of (row key, token id); the first index wins ties.

The fast path (``kernels/triton_sampling.py``) computes the same function without a sort
(threshold search over float keys) and is compared with this one in the tests.
Penalties (vLLM semantics) are applied before step 1; log-probs are of the RAW logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_async.inference.sample_keys import M32, mix32, row_keys

GREEDY_TEMPERATURE = 1e-5
MASS_SCALE = 4294967296.0  # 2**32: top-p weight units per unit of exp(s - max)


@dataclass
class RowParams:
    """Per-row sampling parameters, [R] device tensors (views of the step snapshot)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor


@dataclass
class PenaltyRows:
    """Per-row penalty parameters and the device rows they read (see sampling_state.py)."""

    slot: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    suppress_stop: torch.Tensor
    counts: torch.Tensor  # [slots + 1, V] int32
    prompt_mask: torch.Tensor  # [slots + 1, V] bool
    stop_mask: torch.Tensor  # [slots + 1, V] bool
    bias_ids: torch.Tensor | None = None  # [slots + 1, B] int64 (logit_bias)
    bias_values: torch.Tensor | None = None  # [slots + 1, B] float32
    banned: torch.Tensor | None = None  # [slots + 1, V] bool (allowed_token_ids, bad_words)
    history: torch.Tensor | None = None  # [slots + 1, W] int64 newest generated tokens (bad_words of several tokens)
    word_prefix: torch.Tensor | None = None  # [slots + 1, M, W] int64
    word_last: torch.Tensor | None = None  # [slots + 1, M] int64


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R] keys -> [R, V] float32 uniforms in (0, 1), one per (row, token id)."""
    tok = mix32(torch.arange(vocab_size, device=keys.device, dtype=torch.int64) * 0x27D4EB2F & M32)
    bits = mix32(keys[:, None] ^ tok[None, :]) >> 8  # 24 random bits: exact in float32
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def inverse_temperature(temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (inv_t [R] float32, 1 for greedy rows; greedy [R] bool). Shared by both paths."""
    greedy = temperature < GREEDY_TEMPERATURE  # smaller ones overflow logits / t in float32
    safe = torch.where(greedy, torch.ones_like(temperature), temperature)
    return 1.0 / safe, greedy


def keep_mask(s: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[R, V] bool: the kept set of step 2 (0 / off values keep everything)."""
    R, V = s.shape
    e = torch.exp(s - s.amax(-1, keepdim=True))
    mp = min_p[:, None]
    keep = (mp <= 0) | (e >= mp)
    sorted_s, order = torch.sort(s, dim=-1, descending=True)
    k = top_k[:, None]
    kth = sorted_s.gather(-1, (k.clamp(1, V) - 1))
    keep &= ~((k > 0) & (k < V)) | (s >= kth)
    p = top_p[:, None]
    w = torch.where(keep, torch.floor(e * MASS_SCALE), torch.zeros_like(e)).double()
    cw = w.gather(-1, order).cumsum(-1)  # exact: integer-valued float64 below 2**53
    target = p.double() * cw[:, -1:]
    first = (cw >= target).to(torch.int8).argmax(-1, keepdim=True)
    tau = sorted_s.gather(-1, first)
    keep &= ~((p > 0) & (p < 1)) | (s >= tau)
    return keep


def sample_reference(logits: torch.Tensor, params: RowParams, any_filter: bool) -> torch.Tensor:
    """logits [R, V] float32 (penalties applied) -> tokens [R] int64, by the definition above."""
    inv_t, greedy = inverse_temperature(params.temperature)
    s = logits * inv_t[:, None]
    score = s + gumbel_noise(row_keys(params.seed, params.position), logits.shape[-1])
    if any_filter:
        keep = keep_mask(s, params.top_k, params.top_p, params.min_p)
        score = score.masked_fill(~keep, float("-inf"))
    return torch.where(greedy, logits.argmax(dim=-1), score.argmax(dim=-1))


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise(keys, vocab_size)))


def apply_penalties_reference(logits: torch.Tensor, pen: PenaltyRows) -> torch.Tensor:
    """vLLM's penalties on a copy of ``logits``: repetition over prompt + output tokens
    (positive logits divided, negative multiplied), frequency and presence over output
    tokens; then ``min_tokens``: the row's stop ids to -inf while ``suppress_stop``."""
    counts = pen.counts[pen.slot]
    seen_out = counts > 0
    rep = torch.where(seen_out | pen.prompt_mask[pen.slot], pen.repetition[:, None], torch.ones_like(logits[:1]))
    out = torch.where(logits > 0, logits / rep, logits * rep)
    out = out - pen.frequency[:, None] * counts
    out = out - pen.presence[:, None] * seen_out
    return out.masked_fill(pen.stop_mask[pen.slot] & pen.suppress_stop[:, None], float("-inf"))


def apply_bias_and_bans(logits: torch.Tensor, pen: PenaltyRows) -> torch.Tensor:
    """After the penalties (``logits``: their float32 copy, changed in place): each row's logit
    bias added (float32; padding pairs add 0.0 to token 0), its banned tokens to -inf, and the last
    token of each of its several-token ``bad_words`` whose other tokens are the newest generated
    ones (vLLM's rule; prefix entries -1 match anything, a word padded with -2 never matches)."""
    logits.scatter_add_(1, pen.bias_ids[pen.slot], pen.bias_values[pen.slot])
    if pen.word_last is not None:
        prefix = pen.word_prefix[pen.slot]  # [R, M, W]
        hit = ((prefix == pen.history[pen.slot][:, None, :]) | (prefix == -1)).all(dim=-1)
        logits.scatter_add_(1, pen.word_last[pen.slot], torch.zeros_like(hit, dtype=logits.dtype).masked_fill_(hit, float("-inf")))
    return logits.masked_fill_(pen.banned[pen.slot], float("-inf"))


def log_probs_of(logits: torch.Tensor, tokens: torch.Tensor, top_n: int, batch_invariant: bool = False,
                 triton: bool = False):
    """Log-probabilities of the RAW model distribution (no penalties, temperature or
    filters, as vLLM's default raw log-probs): of the sampled tokens [R], and the top-n
    (values [R, n], ids [R, n]) when top_n > 0. ``batch_invariant``: the log-sum-exp is
    ``triton_log_softmax.row_lse`` of the logits in their own dtype (one program per row, in
    a fixed order; torch's reductions pick their split, and so their summation order, from
    the whole [R, V] shape). Its bits depend on the input dtype on CUDA (the reduction order
    follows the register layout, which follows the load width), so every path takes it from
    the logits as given, never from a float32 copy. ``triton``: the same values from
    ``kernels/triton_log_probs.py`` (one read of the logits in their own dtype, no [R, V]
    copy; outside batch-invariant mode its log-sum-exp rounds differently), for top_n up to
    its ``MAX_TOP_N``. Logits of any float dtype: this path reads them as float32."""
    if triton:
        from megatron_async.kernels import triton_log_probs

        if top_n <= triton_log_probs.MAX_TOP_N:
            return triton_log_probs.log_probs(logits, tokens, top_n, batch_invariant)
    x = logits.float()
    if batch_invariant:
        from megatron_async.kernels import triton_log_softmax

        lse = triton_log_softmax.row_lse(logits)[:, None]  # of the logits as given (see above)
    else:
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = (x.gather(-1, tokens[:, None]) - lse)[:, 0]
    if top_n > 0:  # batch-invariant: the order of x - lse, whose rounding ties values x separates
        ids = top_ids_lowest_first(x - lse if batch_invariant else x, top_n)
        return chosen, x.gather(-1, ids) - lse, ids
    return chosen, None, None


def top_ids_lowest_first(x: torch.Tensor, n: int) -> torch.Tensor:
    """Ids [R, n] of the n largest values of float rows x [R, V], ties to the lowest id. A plain
    ``topk`` breaks ties by its own algorithm, which depends on n: a CUDA graph (captured for
    ``GRAPH_TOP_N`` alternatives) and an eager step (the step's own maximum) would report
    different ids for equal bf16 log-probs. Here the order is a function of the row only: one
    int64 key per entry, the value's order-preserving float32 bits above the inverted id."""
    bits = (x.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes 0.0, so the two tie
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    inv_id = x.shape[-1] - 1 - torch.arange(x.shape[-1], device=x.device)
    keys = (ordered << 32) | inv_id
    return x.shape[-1] - 1 - (keys.topk(n, dim=-1).values & 0xFFFFFFFF)
