"""The exact threshold search of the sort-free sampler (top-k and top-p), without sorting.

Per row, a threshold is the largest float key ``x`` with ``W(key >= x) >= target``: W counts
elements (top-k, target k) or sums the reference's fixed-point masses (top-p, target p x the
survivors' mass; integer-valued float64 sums, exact in any order). One stage finds it in
few passes over the logits instead of a pass per few bits:
1. histogram pass (rows x chunks grid): each in-play element falls into one of P buckets of
   a monotone function of its value, ``clamp(floor((s - vlo) * inv), 0, P - 1)``, spread
   over the row's value range; per chunk the P counts (and masses) are summed in int32
   register tiles (no per-element atomics, one reduction per chunk);
2. update (one program per row): the bucket holding the threshold is the highest one whose
   suffix weight reaches the target; the weight above it and its element count are kept,
   and the next level spreads P buckets over that bucket's value range;
3. once the chosen bucket holds <= CAP elements (<= CAP / 8 after the first level: a row whose
   first bucket holds thousands takes the second histogram, so the buffer that the per-row
   search walks once a pass, one program's chain, holds a bucket of the finer level), the next
   pass compacts exactly those into a per-row buffer (offsets from the per-chunk counts:
   deterministic, no atomics), and a per-row program finishes the search in key space over the
   buffer alone.
Rows whose bucket still holds > CAP elements after two levels (huge tie plateaus) take a
per-row key-space search over the whole row: slow, exact, rare. Any monotone bucket
function keeps the search exact, so float rounding in the bucket bounds only costs balance.
All launches have fixed grids and read their work from device tensors: CUDA-graph safe."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_sampling_common import (
    element, inv_temperature, key_of, row_filters, row_max, value_of, weight_halves,
)

KEY_MIN = -(2**31)  # at or below every key: "keep everything"
_NEG_INF = tl.constexpr(float("-inf"))
_POS_INF = tl.constexpr(float("inf"))
# row phases of a stage
_SEARCH, _COMPACT, _BUFFERED, _IDLE = 0, 1, 2, 3


@triton.jit
def _bucket(s, vlo, inv, P: tl.constexpr):
    t = (s - vlo) * inv
    t = tl.where(t > 0.0, t, 0.0)  # NaN (-inf * 0) -> 0
    t = tl.where(t < P - 1.0, t, P - 1.0)
    return t.to(tl.int32)


@triton.jit
def _stage_init_kernel(temp_ptr, k_ptr, p_ptr, pmax_ptr, pmin_ptr, NS, V, floor_in_ptr, floor_out_ptr,
                       phase_ptr, whi_ptr, target_ptr, vlo_ptr, inv_ptr, skip_ptr,
                       MASS: tl.constexpr, P: tl.constexpr, NS_BLOCK: tl.constexpr, HAS_SKIP: tl.constexpr):
    row = tl.program_id(0)
    ns = tl.arange(0, NS_BLOCK)
    m = row_max(pmax_ptr, row, NS, NS_BLOCK)
    smin = tl.min(tl.load(pmin_ptr + row * NS + ns, mask=ns < NS, other=_POS_INF), axis=0)
    _, greedy = inv_temperature(tl.load(temp_ptr + row))
    floor = tl.load(floor_in_ptr + row)
    tl.store(floor_out_ptr + row, floor)
    if MASS:
        p = tl.load(p_ptr + row)
        active = (p > 0) & (p < 1)
        # weights vanish below m - 23 (exp < 2**-32); the top-k survivors start at the floor
        fv = tl.where(floor > -(2**31), value_of(floor.to(tl.int32)), _NEG_INF)
        vlo = tl.maximum(tl.maximum(smin, m - 24.0), fv)
        target = tl.full((), -1.0, tl.float64)  # p x the survivors' mass, set by the first update
    else:
        k = tl.load(k_ptr + row)
        active = (k > 0) & (k < V) & (smin < _POS_INF)  # a row of -inf only keeps everything
        vlo = smin
        target = k.to(tl.float64)
    if HAS_SKIP:  # rows already decided (triton_top_p_candidate) search nothing
        active = active & (tl.load(skip_ptr + row) == 0)
    width = m - vlo
    tl.store(phase_ptr + row, tl.where(active & (greedy == 0), 0, 3).to(tl.int32))
    tl.store(whi_ptr + row, tl.zeros((), tl.float64))
    tl.store(target_ptr + row, target.to(tl.float64))
    tl.store(vlo_ptr + 2 * row, vlo)
    tl.store(inv_ptr + 2 * row, tl.where(width > 0, P / width, 0.0))


@triton.jit
def _histogram_chunk(base, row, c, V, NS, offs, pj, inv_t, m, minp, floor, vlo0, inv0, hvlo, hinv, sel0, part_c_ptr,
                     part_w_ptr, MASS: tl.constexpr, NLEV: tl.constexpr, EXACT: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr, P: tl.constexpr, SHIFT: tl.constexpr):
    """Chunk ``c`` of the row: the counts (and, for top-p, the weights) of its in-play elements
    in each of the P buckets spread by (``hvlo``, ``hinv``), those of level 1 only over the
    members of the level-0 bucket ``sel0``; stored at the chunk's place in the partials
    (``offs``: 0 .. BLOCK - 1, ``pj``: 0 .. P - 1)."""
    # int32 tiles: weight = hi * 2**16 + lo; lo's tile also counts, in bits SHIFT and up
    acc_a = tl.zeros((BLOCK, P), tl.int32)
    acc_b = tl.zeros((BLOCK, P), tl.int32)
    col = offs[:, None]  # [BLOCK, 1] elements: each thread then owns whole tile rows
    for off in range(0, CHUNK, BLOCK):
        idx = c * CHUNK + off + col
        valid = idx < V
        x = tl.load(base + idx, mask=valid, other=_NEG_INF).to(tl.float32)
        s, key, w, play = element(x, valid, inv_t, m, minp, floor, MASS, EXACT)
        if NLEV >= 1:
            play = play & (_bucket(s, vlo0, inv0, P) == sel0)
        hit = tl.where(play, _bucket(s, hvlo, hinv, P), -1) == pj[None, :]
        if MASS:
            wh, wl = weight_halves(w)
            acc_a += tl.where(hit, wh, 0)
            acc_b += tl.where(hit, wl + (1 << SHIFT), 0)
        else:
            acc_b += hit.to(tl.int32)
    out = (row * NS + c) * P + pj
    if MASS:
        cnt = tl.sum(acc_b >> SHIFT, axis=0)
        lo = tl.sum(acc_b & ((1 << SHIFT) - 1), axis=0)
        hi = tl.sum(acc_a, axis=0)
        tl.store(part_w_ptr + out, hi.to(tl.float64) * 65536.0 + lo.to(tl.float64))
    else:
        cnt = tl.sum(acc_b, axis=0)
    tl.store(part_c_ptr + out, cnt)


@triton.jit
def _compact_chunk(base, row, c, V, NS, offs, inv_t, m, minp, floor, vlo0, inv0, vlo1, inv1, sel0, sel1, part_c_ptr,
                   buf_key_ptr, buf_w_ptr, MASS: tl.constexpr, NLEV: tl.constexpr, EXACT: tl.constexpr,
                   CHUNK: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr, NS_BLOCK: tl.constexpr,
                   CAP: tl.constexpr):
    """Chunk ``c``'s members of the chosen buckets (of levels < NLEV), copied in order into the
    row's buffer after those of the earlier chunks (at most CAP in all; ``offs``: 0 .. BLOCK - 1)."""
    # this chunk's offset in the row's buffer: the chosen bucket's counts of earlier chunks
    sel = sel0
    if NLEV == 2:
        sel = sel1
    ns = tl.arange(0, NS_BLOCK)
    pos = tl.sum(tl.load(part_c_ptr + (row * NS + ns) * P + sel, mask=ns < c, other=0), axis=0)
    for off in range(0, CHUNK, BLOCK):
        idx = c * CHUNK + off + offs
        valid = idx < V
        x = tl.load(base + idx, mask=valid, other=_NEG_INF).to(tl.float32)
        s, key, w, play = element(x, valid, inv_t, m, minp, floor, MASS, EXACT)
        play = play & (_bucket(s, vlo0, inv0, P) == sel0)
        if NLEV == 2:
            play = play & (_bucket(s, vlo1, inv1, P) == sel1)
        mi = play.to(tl.int32)
        n_in = tl.sum(mi, axis=0)
        if n_in > 0:  # most blocks hold no candidate: skip the scan
            at = pos + tl.cumsum(mi, axis=0) - mi
            keep = play & (at < CAP)
            tl.store(buf_key_ptr + row * CAP + at, key, mask=keep)
            if MASS:
                tl.store(buf_w_ptr + row * CAP + at, w, mask=keep)
        pos += n_in


@triton.jit
def _level_pass_kernel(logits_ptr, stride, V, temp_ptr, pmax_ptr, NS, minp_ptr, floor_ptr,
                       phase_ptr, vlo_ptr, inv_ptr, sel_ptr, part_c_ptr, part_w_ptr, buf_key_ptr, buf_w_ptr,
                       MASS: tl.constexpr, NLEV: tl.constexpr, HIST: tl.constexpr, EXACT: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr, NS_BLOCK: tl.constexpr,
                       CAP: tl.constexpr, SHIFT: tl.constexpr):
    """Rows in _SEARCH: histogram of level NLEV over the members of levels < NLEV.
    Rows in _COMPACT: copy the members of levels < NLEV into the row's buffer."""
    row, c = tl.program_id(0), tl.program_id(1)
    phase = tl.load(phase_ptr + row)
    run = phase < 0
    if HIST:
        run = run | (phase == 0)
    if NLEV > 0:
        run = run | (phase == 1)
    if run:
        base = logits_ptr + row.to(tl.int64) * stride
        inv_t, _ = inv_temperature(tl.load(temp_ptr + row))
        m = 0.0
        minp = 0.0
        floor = 0
        if MASS:
            m, minp, floor = row_filters(pmax_ptr, minp_ptr, floor_ptr, row, NS, NS_BLOCK, MASS)
        vlo0 = tl.load(vlo_ptr + 2 * row)
        inv0 = tl.load(inv_ptr + 2 * row)
        vlo1 = tl.load(vlo_ptr + 2 * row + 1)
        inv1 = tl.load(inv_ptr + 2 * row + 1)
        sel0 = tl.load(sel_ptr + 2 * row)
        sel1 = tl.load(sel_ptr + 2 * row + 1)
        offs = tl.arange(0, BLOCK)
        pj = tl.arange(0, P)
        if phase == 0:
            hvlo = vlo0
            hinv = inv0
            if NLEV == 1:
                hvlo = vlo1
                hinv = inv1
            _histogram_chunk(base, row, c, V, NS, offs, pj, inv_t, m, minp, floor, vlo0, inv0, hvlo, hinv, sel0,
                             part_c_ptr, part_w_ptr, MASS, NLEV, EXACT, CHUNK, BLOCK, P, SHIFT)
        else:
            _compact_chunk(base, row, c, V, NS, offs, inv_t, m, minp, floor, vlo0, inv0, vlo1, inv1, sel0, sel1,
                           part_c_ptr, buf_key_ptr, buf_w_ptr, MASS, NLEV, EXACT, CHUNK, BLOCK, P, NS_BLOCK, CAP)


@triton.jit
def _level_update_kernel(phase_ptr, p_ptr, whi_ptr, target_ptr, cnt_ptr, vlo_ptr, inv_ptr, sel_ptr,
                         part_c_ptr, part_w_ptr, NS, MASS: tl.constexpr, LEVEL: tl.constexpr, P: tl.constexpr,
                         NS_BLOCK: tl.constexpr, CAP: tl.constexpr):
    """Picks the bucket holding the threshold: the highest with whi + suffix weight >= target."""
    row = tl.program_id(0)
    phase = tl.load(phase_ptr + row)
    if phase == 0:
        ns = tl.arange(0, NS_BLOCK)
        pj = tl.arange(0, P)
        at = (row * NS + ns[:, None]) * P + pj[None, :]
        inside = ns[:, None] < NS
        hc = tl.sum(tl.load(part_c_ptr + at, mask=inside, other=0), axis=0)
        if MASS:
            hw = tl.sum(tl.load(part_w_ptr + at, mask=inside, other=0.0), axis=0)  # integer-valued: exact
        else:
            hw = hc.to(tl.float64)
        whi = tl.load(whi_ptr + row)
        target = tl.load(target_ptr + row)
        total = tl.sum(hw, axis=0)
        if MASS:
            if LEVEL == 0:
                target = tl.load(p_ptr + row).to(tl.float64) * (whi + total)
                tl.store(target_ptr + row, target)
        suffix = total - tl.cumsum(hw, axis=0) + hw
        j = tl.max(tl.where(whi + suffix >= target, pj, 0), axis=0)
        pick = pj == j
        tl.store(whi_ptr + row, whi + tl.sum(tl.where(pick, suffix - hw, 0.0), axis=0))
        cnt = tl.sum(tl.where(pick, hc, 0), axis=0)
        tl.store(cnt_ptr + row, cnt)
        tl.store(sel_ptr + 2 * row + LEVEL, j)
        if LEVEL == 0:  # the next level spreads P buckets over bucket j's value range
            vlo = tl.load(vlo_ptr + 2 * row)
            inv = tl.load(inv_ptr + 2 * row)
            tl.store(vlo_ptr + 2 * row + 1, tl.where(inv > 0, vlo + j.to(tl.float32) / inv, vlo))
            tl.store(inv_ptr + 2 * row + 1, inv * P)
        limit = CAP // 8 if LEVEL == 0 else CAP
        tl.store(phase_ptr + row, tl.where(cnt <= limit, 1, 0).to(tl.int32))
    elif phase == 1:
        tl.store(phase_ptr + row, 2)


@triton.jit
def _finish_kernel(logits_ptr, stride, V, temp_ptr, pmax_ptr, NS, minp_ptr, floor_ptr, out_ptr,
                   phase_ptr, whi_ptr, target_ptr, cnt_ptr, buf_key_ptr, buf_w_ptr,
                   MASS: tl.constexpr, EXACT: tl.constexpr, CAP: tl.constexpr, SB: tl.constexpr,
                   P: tl.constexpr, NS_BLOCK: tl.constexpr):
    """Key-space search of [lo, hi) with P pivots a step, over the row's buffer (phases 1, 2)
    or, for rows never compacted, over the whole row from scratch."""
    row = tl.program_id(0)
    phase = tl.load(phase_ptr + row)
    if phase != 3:
        buffered = phase != 0
        base = logits_ptr + row.to(tl.int64) * stride
        inv_t, _ = inv_temperature(tl.load(temp_ptr + row))
        m = row_max(pmax_ptr, row, NS, NS_BLOCK)
        minp = tl.load(minp_ptr + row)
        floor = tl.load(floor_ptr + row)
        target = tl.load(target_ptr + row)
        offs = tl.arange(0, SB)
        pj = tl.arange(0, P)
        n = tl.load(cnt_ptr + row)
        if buffered:
            whi = tl.load(whi_ptr + row)
            lo = tl.full((), 2**31, tl.int64)
            hi = tl.full((), -(2**31), tl.int64)
            for i0 in range(0, n, SB):
                i = i0 + offs
                k = tl.load(buf_key_ptr + row * CAP + i, mask=i < n, other=0).to(tl.int64)
                lo = tl.minimum(lo, tl.min(tl.where(i < n, k, 2**31), axis=0))
                hi = tl.maximum(hi, tl.max(tl.where(i < n, k + 1, -(2**31)), axis=0))
        else:
            whi = tl.zeros((), tl.float64)
            lo = tl.full((), -(2**31), tl.int64)
            hi = key_of(m).to(tl.int64) + 1
            n = V
        while hi - lo > 1:
            step = (hi - lo + P - 1) // P
            piv = lo + pj.to(tl.int64) * step
            pnext = tl.minimum(piv + step, hi)  # pivot j's interval: [piv_j, pnext_j)
            acc = tl.zeros((P,), tl.float64)
            first = tl.full((P,), 2**31, tl.int64)  # the smallest weighted key of each interval
            last = tl.full((P,), -(2**31) - 1, tl.int64)  # and the largest
            for i0 in range(0, n, SB):
                i = i0 + offs
                if buffered:
                    k = tl.load(buf_key_ptr + row * CAP + i, mask=i < n, other=0)
                    if MASS:
                        w = tl.load(buf_w_ptr + row * CAP + i, mask=i < n, other=0.0).to(tl.float64)
                    else:
                        w = (i < n).to(tl.float64)
                else:
                    x = tl.load(base + i, mask=i < n, other=_NEG_INF).to(tl.float32)
                    sv, k, wf, play = element(x, i < n, inv_t, m, minp, floor, MASS, EXACT)
                    w = tl.where(play, wf, 0.0).to(tl.float64)
                k = k.to(tl.int64)
                w = tl.where(k < hi, w, 0.0)  # the weight at or above hi is in whi
                above = k[:, None] >= piv[None, :]
                acc += tl.sum(tl.where(above, w[:, None], 0.0), axis=0)
                inside = above & (k[:, None] < pnext[None, :]) & (w[:, None] > 0.0)
                first = tl.minimum(first, tl.min(tl.where(inside, k[:, None], 2**31), axis=0))
                last = tl.maximum(last, tl.max(tl.where(inside, k[:, None], -(2**31) - 1), axis=0))
            ok = ((whi + acc) >= target) & (piv < hi)
            j = tl.max(tl.where(ok, pj, 0), axis=0)
            nxt = lo + (j + 1).to(tl.int64) * step
            has_next = (j + 1 < P) & (nxt < hi)
            whi = tl.where(has_next, whi + tl.sum(tl.where(pj == j + 1, acc, 0.0), axis=0), whi)
            # the threshold is a weighted key of interval j (W only steps at them): narrow to its
            # first and last such key, so the search ends once one distinct key is left rather
            # than after a pass per 4 bits of the interval's key span (16-bit logits: few keys)
            kf = tl.sum(tl.where(pj == j, first, 0), axis=0)
            kl = tl.sum(tl.where(pj == j, last, 0), axis=0)
            lo_j = lo + j.to(tl.int64) * step
            hi_j = tl.where(has_next, nxt, hi)
            snap = kf <= kl
            lo = tl.where(snap, kf, lo_j)
            hi = tl.where(snap, kl + 1, hi_j)
        tl.store(out_ptr + row, lo)


class StageLaunch:
    """Grid and tile settings of one ``sample`` call, shared by its stages."""

    def __init__(self, logits: torch.Tensor, chunk: int, hist_block: int, search_block: int, pivots: int, cap: int,
                 num_warps: int, exact: bool, finish_warps: int | None = None):
        self.R, self.V = logits.shape
        self.ns = triton.cdiv(self.V, chunk)
        self.ns_block = triton.next_power_of_2(self.ns)
        # a tile element adds <= chunk / hist_block weights of < 2**16 (lo) and as many ones (count)
        adds = (chunk // hist_block - 1).bit_length()
        assert chunk % hist_block == 0 and 16 + 2 * adds + 1 <= 31 and chunk <= 16384, "int32 tile fields overflow"
        self.shift = 16 + adds
        self.chunk, self.hist_block, self.search_block, self.pivots, self.cap = chunk, hist_block, search_block, pivots, cap
        self.num_warps, self.exact = num_warps, exact
        self.finish_warps = finish_warps or num_warps  # the per-row search's program


def threshold(L: StageLaunch, logits, temperature, top_k, top_p, min_p, pmax, pmin, floor_in: torch.Tensor,
              mass: bool, probe: list | None = None, skip: torch.Tensor | None = None) -> torch.Tensor:
    """One filter's thresholds [R] int64 (the input floor for rows that do not use it, and for
    rows with ``skip`` [R] int32 set)."""
    R, V, ns, P, dev = L.R, L.V, L.ns, L.pivots, logits.device
    phase = torch.empty(R, dtype=torch.int32, device=dev)
    cnt = torch.zeros(R, dtype=torch.int32, device=dev)
    whi = torch.empty(R, dtype=torch.float64, device=dev)
    target = torch.empty(R, dtype=torch.float64, device=dev)
    vlo = torch.empty(R, 2, dtype=torch.float32, device=dev)
    inv = torch.empty(R, 2, dtype=torch.float32, device=dev)
    sel = torch.zeros(R, 2, dtype=torch.int32, device=dev)
    part_c = torch.empty(R, ns, P, dtype=torch.int32, device=dev)
    part_w = torch.empty(R, ns, P, dtype=torch.float64, device=dev) if mass else part_c
    buf_key = torch.empty(R, max(L.cap, 1), dtype=torch.int32, device=dev)  # cap 0: never compact (tests)
    buf_w = torch.empty(R, max(L.cap, 1), dtype=torch.float32, device=dev) if mass else buf_key
    out = torch.empty(R, dtype=torch.int64, device=dev)
    _stage_init_kernel[(R,)](temperature, top_k, top_p, pmax, pmin, ns, V, floor_in, out, phase, whi, target,
                             vlo, inv, out if skip is None else skip, MASS=mass, P=P, NS_BLOCK=L.ns_block,
                             HAS_SKIP=skip is not None)
    row_args = (logits, logits.stride(0), V, temperature, pmax, ns, min_p, floor_in)
    for level, hist in ((0, True), (1, True), (2, False)):
        _level_pass_kernel[(R, ns)](*row_args, phase, vlo, inv, sel, part_c, part_w, buf_key, buf_w,
                                    MASS=mass, NLEV=level, HIST=hist, EXACT=L.exact, CHUNK=L.chunk,
                                    BLOCK=L.hist_block, P=P, NS_BLOCK=L.ns_block, CAP=L.cap, SHIFT=L.shift,
                                    num_warps=L.num_warps, enable_fp_fusion=False)
        if level < 2:
            _level_update_kernel[(R,)](phase, top_p, whi, target, cnt, vlo, inv, sel, part_c, part_w, ns,
                                       MASS=mass, LEVEL=level, P=P, NS_BLOCK=L.ns_block, CAP=L.cap)
    if probe is not None:  # tests: which rows finished from the buffer (1, 2) or the whole row (0)
        probe.append(phase.clone())
    _finish_kernel[(R,)](*row_args, out, phase, whi, target, cnt, buf_key, buf_w, MASS=mass, EXACT=L.exact,
                         CAP=L.cap, SB=L.search_block, P=P, NS_BLOCK=L.ns_block,
                         num_warps=L.finish_warps, enable_fp_fusion=False)
    return out
