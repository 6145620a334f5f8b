"""Sort-free sampling: the function of ``sampling.py``'s reference, one program per row.

Passes over the row (logits stay in global memory; each pass re-reads them):
- filtered rows: one pass for the row max and the smallest float key;
- top-k: a threshold search over the float32 keys (monotone int keys of ``s``): each pass
  counts the elements at or above P pivots spread over the remaining key interval and keeps
  the sub-interval that holds the k-th largest key, until one key remains (about
  log_P(range) passes, 8 for P = 16 over the whole float range);
- top-p: the same search with the fixed-point masses of the reference (integer-valued
  float64 sums, exact in any order), so the boundary equals the reference's bit for bit;
- one final pass: Gumbel-max over the kept set, the noise hashed from (row key, token id)
  on the fly; greedy rows take the plain argmax.
The arithmetic mirrors the reference op for op (float32 multiply by 1/t, IEEE division,
correctly rounded exp / log from libdevice on CUDA, FMA contraction off), so the tokens are
the reference's. Shapes come from tensor metadata only and nothing syncs: CUDA-graph safe."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_NEG_INF = float("-inf")


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _mix32(x):
    x = (x ^ (x >> 16)) * 0x7FEB352D
    x = (x ^ (x >> 15)) * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel(rkey, idx, EXACT: tl.constexpr):
    tok = _mix32(idx.to(tl.uint32) * 0x27D4EB2F)
    bits = _mix32(rkey ^ tok) >> 8
    u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -_log(-_log(u, EXACT), EXACT)


@triton.jit
def _key(s):
    """float32 -> int64 key with the same order (-0 == +0)."""
    s = tl.where(s == 0.0, 0.0, s)
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _search(base, V, inv_t, m, minp, lo, hi, floor_key, target, p,
            MASS: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr):
    """Largest key t in [lo, hi) with W(key >= t) >= target, W summing over the elements with
    key >= floor_key (and exp(s - m) >= minp for MASS) a weight of 1 (counts) or the
    fixed-point mass. Invariant: W(>= lo) >= target > W(>= hi). For MASS the target is
    p * W(>= lo), taken from the first pass."""
    offs = tl.arange(0, BLOCK)
    pj = tl.arange(0, P)
    w_hi = tl.zeros((), tl.float64)
    it = 0
    while hi - lo > 1:
        step = (hi - lo + P - 1) // P
        piv = lo + pj.to(tl.int64) * step
        acc = tl.zeros((P,), tl.float64)
        for start in range(0, V, BLOCK):
            idx = start + offs
            valid = idx < V
            s = tl.load(base + idx, mask=valid, other=_NEG_INF) * inv_t
            kk = _key(s)
            inside = valid & (kk >= floor_key) & (kk < hi)
            if MASS:
                e = _exp(s - m, EXACT)
                inside = inside & (e >= minp)
                w = tl.floor(e * 4294967296.0).to(tl.float64)
            else:
                w = tl.full((BLOCK,), 1.0, tl.float64)
            w = tl.where(inside, w, 0.0)
            acc += tl.sum(tl.where(kk[:, None] >= piv[None, :], w[:, None], 0.0), axis=0)
        if MASS:
            if it == 0:
                target = p.to(tl.float64) * tl.sum(tl.where(pj == 0, acc, 0.0), axis=0)
        it += 1
        ok = ((w_hi + acc) >= target) & (piv < hi)
        j = tl.max(tl.where(ok, pj, 0), axis=0)
        nxt = lo + (j + 1).to(tl.int64) * step
        has_next = (j + 1 < P) & (nxt < hi)
        w_next = tl.sum(tl.where(pj == j + 1, acc, 0.0), axis=0)
        w_hi = tl.where(has_next, w_hi + w_next, w_hi)
        lo, hi = lo + j.to(tl.int64) * step, tl.where(has_next, nxt, hi)
    return lo


@triton.jit
def _sample_kernel(logits_ptr, stride, V, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr, min_p_ptr, key_ptr, out_ptr,
                   FILTER: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                   P: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    inv_t = tl.load(inv_t_ptr + row)
    greedy = tl.load(greedy_ptr + row)
    rkey = tl.load(key_ptr + row).to(tl.uint32)
    floor_key = tl.full((), -(2**31), tl.int64)  # below every key: keep all
    m = tl.zeros((), tl.float32)
    minp = tl.zeros((), tl.float32)
    if FILTER:
        if greedy == 0:
            k = tl.load(top_k_ptr + row)
            p = tl.load(top_p_ptr + row)
            minp = tl.load(min_p_ptr + row)
            m = tl.full((), _NEG_INF, tl.float32)
            above_all = tl.full((), 2**31, tl.int64)
            kmin = above_all
            for start in range(0, V, BLOCK):
                idx = start + offs
                valid = idx < V
                s = tl.load(base + idx, mask=valid, other=_NEG_INF) * inv_t
                m = tl.maximum(m, tl.max(s, axis=0))
                kmin = tl.minimum(kmin, tl.min(tl.where(valid, _key(s), above_all), axis=0))
            hi = _key(m) + 1
            if (k > 0) & (k < V):
                floor_key = _search(base, V, inv_t, m, minp, kmin, hi, floor_key, k.to(tl.float64), p,
                                    False, EXACT, SEARCH_BLOCK, P)
            if (p > 0) & (p < 1):
                lo = tl.maximum(kmin, floor_key)
                floor_key = _search(base, V, inv_t, m, minp, lo, hi, floor_key, tl.zeros((), tl.float64), p,
                                    True, EXACT, SEARCH_BLOCK, P)
    best = tl.full((), _NEG_INF, tl.float32)
    best_i = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        valid = idx < V
        x = tl.load(base + idx, mask=valid, other=_NEG_INF)
        if greedy != 0:
            score = x
        else:
            s = x * inv_t
            score = s + _gumbel(rkey, idx, EXACT)
            if FILTER:
                keep = _key(s) >= floor_key
                if minp > 0:
                    keep = keep & (_exp(s - m, EXACT) >= minp)
                score = tl.where(keep, score, _NEG_INF)
        score = tl.where(valid, score, _NEG_INF)
        bv, bi = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = bv > best
        best_i = tl.where(better, start + bi, best_i)
        best = tl.where(better, bv, best)
    tl.store(out_ptr + row, best_i.to(tl.int64))


def sample(logits: torch.Tensor, inv_t: torch.Tensor, greedy: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, keys: torch.Tensor, any_filter: bool,
           block: int = 1024, search_block: int = 256, pivots: int = 16) -> torch.Tensor:
    """[R, V] float32 logits -> [R] int64 tokens; per-row tensors as in the reference."""
    R, V = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    _sample_kernel[(R,)](
        logits, logits.stride(0), V, inv_t, greedy.to(torch.int8), top_k, top_p, min_p, keys, out,
        FILTER=any_filter, EXACT=not _INTERPRET, BLOCK=block, SEARCH_BLOCK=search_block, P=pivots,
        num_warps=8, enable_fp_fusion=False,
    )
    return out


@triton.jit
def _penalty_kernel(logits_ptr, out_ptr, stride, V, slot_ptr, counts_ptr, pmask_ptr, smask_ptr,
                    pres_ptr, freq_ptr, rep_ptr, sup_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < V
    state = tl.load(slot_ptr + row) * V + idx
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + idx, mask=valid, other=0.0)
    c = tl.load(counts_ptr + state, mask=valid, other=0)
    seen_out = c > 0
    seen = seen_out | (tl.load(pmask_ptr + state, mask=valid, other=0) != 0)
    rep = tl.where(seen, tl.load(rep_ptr + row), 1.0)
    y = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
    y = y - tl.load(freq_ptr + row) * c.to(tl.float32)
    y = y - tl.load(pres_ptr + row) * seen_out.to(tl.float32)
    stop = (tl.load(smask_ptr + state, mask=valid, other=0) != 0) & (tl.load(sup_ptr + row) != 0)
    y = tl.where(stop, _NEG_INF, y)
    tl.store(out_ptr + row.to(tl.int64) * V + idx, y, mask=valid)


def apply_penalties(logits: torch.Tensor, slot, counts, prompt_mask, stop_mask, presence, frequency, repetition,
                    suppress_stop, block: int = 2048) -> torch.Tensor:
    """The reference's ``apply_penalties_reference`` in one pass; returns a new tensor."""
    R, V = logits.shape
    out = torch.empty((R, V), dtype=torch.float32, device=logits.device)
    _penalty_kernel[(R, triton.cdiv(V, block))](
        logits, out, logits.stride(0), V, slot, counts, prompt_mask.view(torch.uint8), stop_mask.view(torch.uint8),
        presence, frequency, repetition, suppress_stop.view(torch.uint8), BLOCK=block, enable_fp_fusion=False,
    )
    return out
