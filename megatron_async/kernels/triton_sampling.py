"""Sort-free sampling: the function of ``sampling.py``'s reference without sorting.

Each row is cut into chunks; every pass is a (rows x chunks) grid over the logits, followed
by a tiny per-row step, so the whole GPU works on every pass:
- filtered steps: one pass for each row's max and smallest float key;
- top-k: a threshold search over the monotone int keys of ``s``: a pass counts, per chunk,
  the elements at or above P pivots spread over the row's remaining key interval; the update
  keeps the sub-interval holding the k-th largest key. A fixed number of passes
  (ceil(32 / log2 P)) pins one key; rows that are done skip their work;
- top-p: the same search over the reference's fixed-point masses (integer-valued float64
  sums: exact in any order), so the boundary equals the reference's bit for bit;
- one draw pass: Gumbel-max over the kept set per chunk, noise hashed from (row key, token
  id) on the fly, greedy rows argmax; the chunk winners are reduced in torch (first max).
The arithmetic mirrors the reference op for op (float32 multiply by 1/t, correctly rounded
exp / log from libdevice on CUDA, FMA contraction off), so the tokens are the reference's.
Shapes come from tensor metadata, pass counts are fixed, nothing syncs: CUDA-graph safe."""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_NEG_INF = tl.constexpr(float("-inf"))


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
def _stats_kernel(logits_ptr, stride, V, inv_t_ptr, pmax_ptr, pkmin_ptr, NS,
                  EXACT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # EXACT: unused, shared kwargs
    row, c = tl.program_id(0), tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride
    inv_t = tl.load(inv_t_ptr + row)
    offs = tl.arange(0, BLOCK)
    above_all = tl.full((), 2**31, tl.int64)
    m = tl.full((), _NEG_INF, tl.float32)
    kmin = above_all
    for off in range(0, CHUNK, BLOCK):
        idx = c * CHUNK + off + offs
        valid = idx < V
        s = tl.load(base + idx, mask=valid, other=_NEG_INF) * inv_t
        m = tl.maximum(m, tl.max(s, axis=0))
        kmin = tl.minimum(kmin, tl.min(tl.where(valid, _key(s), above_all), axis=0))
    tl.store(pmax_ptr + row * NS + c, m)
    tl.store(pkmin_ptr + row * NS + c, kmin)


@triton.jit
def _search_pass_kernel(logits_ptr, stride, V, inv_t_ptr, m_ptr, minp_ptr, floor_ptr, lo_ptr, hi_ptr, part_ptr, NS,
                        MASS: tl.constexpr, EXACT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        P: tl.constexpr):
    """Per chunk: W(key >= pivot_j) over the chunk's elements in [floor, hi), for the P pivots
    lo + j * ceil((hi - lo) / P); W counts (top-k) or sums fixed-point masses (top-p)."""
    row, c = tl.program_id(0), tl.program_id(1)
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    pj = tl.arange(0, P)
    acc = tl.zeros((P,), tl.float64)
    if hi - lo > 1:
        base = logits_ptr + row.to(tl.int64) * stride
        inv_t = tl.load(inv_t_ptr + row)
        m = tl.load(m_ptr + row)
        minp = tl.load(minp_ptr + row)
        floor_key = tl.load(floor_ptr + row)
        piv = lo + pj.to(tl.int64) * ((hi - lo + P - 1) // P)
        offs = tl.arange(0, BLOCK)
        for off in range(0, CHUNK, BLOCK):
            idx = c * CHUNK + off + offs
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
    tl.store(part_ptr + (row * NS + c) * P + pj, acc)


@triton.jit
def _search_update_kernel(lo_ptr, hi_ptr, whi_ptr, target_ptr, p_ptr, part_ptr, NS,
                          MASS: tl.constexpr, P: tl.constexpr, NS_BLOCK: tl.constexpr):
    """Keeps the largest pivot interval with W(>= lo) >= target > W(>= hi). For top-p the
    target (p x the survivors' mass) is set on the first pass from W(>= initial lo)."""
    row = tl.program_id(0)
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    if hi - lo > 1:
        pj = tl.arange(0, P)
        ns = tl.arange(0, NS_BLOCK)
        tile = tl.load(part_ptr + (row * NS + ns[:, None]) * P + pj[None, :], mask=ns[:, None] < NS, other=0.0)
        acc = tl.sum(tile, axis=0)  # integer-valued float64: exact
        w_hi = tl.load(whi_ptr + row)
        target = tl.load(target_ptr + row)
        if MASS:
            if target < 0:
                target = tl.load(p_ptr + row).to(tl.float64) * tl.sum(tl.where(pj == 0, acc, 0.0), axis=0)
                tl.store(target_ptr + row, target)
        step = (hi - lo + P - 1) // P
        piv = lo + pj.to(tl.int64) * step
        ok = ((w_hi + acc) >= target) & (piv < hi)
        j = tl.max(tl.where(ok, pj, 0), axis=0)
        nxt = lo + (j + 1).to(tl.int64) * step
        has_next = (j + 1 < P) & (nxt < hi)
        w_next = tl.sum(tl.where(pj == j + 1, acc, 0.0), axis=0)
        tl.store(whi_ptr + row, tl.where(has_next, w_hi + w_next, w_hi))
        tl.store(lo_ptr + row, lo + j.to(tl.int64) * step)
        tl.store(hi_ptr + row, tl.where(has_next, nxt, hi))


@triton.jit
def _draw_kernel(logits_ptr, stride, V, inv_t_ptr, greedy_ptr, key_ptr, m_ptr, minp_ptr, floor_ptr, best_ptr, idx_ptr,
                 NS, FILTER: tl.constexpr, EXACT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride
    inv_t = tl.load(inv_t_ptr + row)
    greedy = tl.load(greedy_ptr + row)
    rkey = tl.load(key_ptr + row).to(tl.uint32)
    m = tl.load(m_ptr + row)
    minp = tl.load(minp_ptr + row)
    floor_key = tl.load(floor_ptr + row)
    offs = tl.arange(0, BLOCK)
    best = tl.full((), _NEG_INF, tl.float32)
    best_i = tl.zeros((), tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = c * CHUNK + off + offs
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
        best_i = tl.where(better, c * CHUNK + off + bi, best_i)
        best = tl.where(better, bv, best)
    tl.store(best_ptr + row * NS + c, best)
    tl.store(idx_ptr + row * NS + c, best_i.to(tl.int64))


def _torch_key(s: torch.Tensor) -> torch.Tensor:
    """The kernels' ``_key`` for a float32 tensor."""
    b = torch.where(s == 0, torch.zeros_like(s), s).view(torch.int32).to(torch.int64)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


class _Launch:
    """Launch settings shared by the passes of one ``sample`` call."""

    def __init__(self, logits, chunk, block, search_block, pivots, num_warps):
        self.R, self.V = logits.shape
        self.ns = triton.cdiv(self.V, chunk)
        self.grid = (self.R, self.ns)
        self.common = dict(CHUNK=chunk, EXACT=not _INTERPRET, num_warps=num_warps, enable_fp_fusion=False)
        self.block, self.search_block, self.pivots = block, search_block, pivots
        self.passes = math.ceil(32 / math.log2(pivots))  # pins one key of a 2**32 range

    def search(self, logits, inv_t, m, min_p, floor, lo, hi, target, top_p, mass: bool) -> torch.Tensor:
        R, P = self.R, self.pivots
        whi = torch.zeros(R, dtype=torch.float64, device=logits.device)
        part = torch.empty(R, self.ns, P, dtype=torch.float64, device=logits.device)
        for _ in range(self.passes):
            _search_pass_kernel[self.grid](logits, logits.stride(0), self.V, inv_t, m, min_p, floor, lo, hi, part,
                                           self.ns, MASS=mass, BLOCK=self.search_block, P=P, **self.common)
            _search_update_kernel[(R,)](lo, hi, whi, target, top_p, part, self.ns, MASS=mass, P=P,
                                        NS_BLOCK=triton.next_power_of_2(self.ns))
        return lo


def sample(logits: torch.Tensor, inv_t: torch.Tensor, greedy: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, keys: torch.Tensor, filters: tuple[bool, bool, bool] | bool,
           chunk: int = 8192, block: int = 1024, search_block: int = 128, pivots: int = 8,
           num_warps: int = 4) -> torch.Tensor:
    """[R, V] float32 logits -> [R] int64 tokens; per-row tensors as in the reference.
    ``filters``: whether some row uses (top-k, top-p, min-p); True = all (passes of unused
    filters are skipped; a row's own off values are honoured either way).
    Defaults: the fastest of scripts/check_sampling.py's sweep on an H100 (docs/PERFORMANCE.md)."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert chunk % block == 0 and chunk % search_block == 0
    L = _Launch(logits, chunk, block, search_block, pivots, num_warps)
    R, V, dev = L.R, L.V, logits.device
    use_top_k, use_top_p, use_min_p = (filters,) * 3 if isinstance(filters, bool) else filters
    any_filter = use_top_k or use_top_p or use_min_p
    floor = torch.full((R,), -(2**31), dtype=torch.int64, device=dev)  # below every key: keep all
    if any_filter:
        pmax = torch.empty(L.grid, dtype=torch.float32, device=dev)
        pkmin = torch.empty(L.grid, dtype=torch.int64, device=dev)
        _stats_kernel[L.grid](logits, logits.stride(0), V, inv_t, pmax, pkmin, L.ns, BLOCK=block, **L.common)
        m, kmin = pmax.amax(1), pkmin.amin(1)
        top1 = _torch_key(m) + 1
        sampled = ~greedy
        if use_top_k:
            use_k = sampled & (top_k > 0) & (top_k < V)
            lo = kmin.clone()
            floor = torch.where(use_k, L.search(logits, inv_t, m, min_p, floor, lo, torch.where(use_k, top1, lo + 1),
                                                top_k.double(), top_p, mass=False), floor)
        if use_top_p:
            use_p = sampled & (top_p > 0) & (top_p < 1)
            lo = torch.maximum(kmin, floor)
            target = torch.full((R,), -1.0, dtype=torch.float64, device=dev)
            floor = torch.where(use_p, L.search(logits, inv_t, m, min_p, floor, lo, torch.where(use_p, top1, lo + 1),
                                                target, top_p, mass=True), floor)
    else:
        m = torch.zeros(R, dtype=torch.float32, device=dev)
        min_p = torch.zeros_like(m)
    best = torch.empty(L.grid, dtype=torch.float32, device=dev)
    best_idx = torch.empty(L.grid, dtype=torch.int64, device=dev)
    _draw_kernel[L.grid](logits, logits.stride(0), V, inv_t, greedy.to(torch.int8), keys, m, min_p, floor, best,
                         best_idx, L.ns, FILTER=any_filter, BLOCK=block, **L.common)
    top = best.amax(1, keepdim=True)
    first = (best == top).to(torch.int8).argmax(1, keepdim=True)  # the lowest chunk wins ties
    return best_idx.gather(1, first)[:, 0]


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
