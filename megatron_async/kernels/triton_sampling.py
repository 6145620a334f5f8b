"""Sort-free sampling: the function of ``sampling.py``'s reference without sorting.

Each row is cut into chunks; the passes are (rows x chunks) grids over the logits, so the
whole GPU works on every pass:
- filtered steps: one pass for each row's max and smallest finite value;
- top-k, then top-p over its survivors: an exact threshold search each
  (``triton_threshold.py``: two bucket-histogram passes, one compaction pass, a per-row
  search over the few compacted candidates); top-p draws first and searches only the rows
  whose draw fell outside the nucleus (``triton_top_p_candidate.py``);
- one draw pass: Gumbel-max over the kept set per chunk, noise hashed from (row key, token
  id) on the fly (blocks with no kept token skip the noise; exact logs only for the elements
  a fast bound leaves in play: ``triton_gumbel.py``), greedy rows argmax; a per-row program
  picks the first best chunk.
Temperature, greedy flags and row keys are computed in the kernels from the raw per-row
tensors. The arithmetic mirrors the reference op for op (float32 multiply by 1/t, 1/t
rounded to nearest, correctly rounded exp / log from libdevice on CUDA, FMA contraction off),
so the tokens are the reference's. Shapes come from tensor metadata, launch counts are
fixed, nothing syncs: CUDA-graph safe."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels import triton_gumbel as gumbel
from megatron_async.kernels.triton_top_p_candidate import candidate_done
from megatron_async.kernels.triton_sampling_common import EXACT_MATH, exp_, inv_temperature, key_of, row_filters
from megatron_async.kernels.triton_threshold import KEY_MIN, StageLaunch, threshold

_NEG_INF = tl.constexpr(float("-inf"))
_POS_INF = tl.constexpr(float("inf"))


@triton.jit
def _stats_kernel(logits_ptr, stride, V, temp_ptr, pmax_ptr, pmin_ptr, NS,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Per chunk: max and smallest finite value of s = logits / t."""
    row, c = tl.program_id(0), tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride
    inv_t, _ = inv_temperature(tl.load(temp_ptr + row))
    offs = tl.arange(0, BLOCK)
    m = tl.full((), _NEG_INF, tl.float32)
    lo = tl.full((), _POS_INF, tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = c * CHUNK + off + offs
        s = tl.load(base + idx, mask=idx < V, other=_NEG_INF).to(tl.float32) * inv_t
        m = tl.maximum(m, tl.max(s, axis=0))
        lo = tl.minimum(lo, tl.min(tl.where(s > _NEG_INF, s, _POS_INF), axis=0))
    tl.store(pmax_ptr + row * NS + c, m)
    tl.store(pmin_ptr + row * NS + c, lo)


@triton.jit
def _running_best(bv, bi, first, best, best_i):
    """A block's best (bv at index first + bi) replaces the running one only when larger: the
    first index wins ties across blocks."""
    better = bv > best
    return tl.where(better, bv, best), tl.where(better, first + bi, best_i)


@triton.jit
def _exact_best(s, u, near, first, best, best_i, EXACT: tl.constexpr):
    """The block's exact scores where ``near``, folded into the running best."""
    score = tl.where(near, s + gumbel.exact(u, EXACT), _NEG_INF)
    bv, bi = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    return _running_best(bv, bi, first, best, best_i)


@triton.jit
def _draw_kernel(logits_ptr, stride, V, temp_ptr, seed_ptr, pos_ptr, pmax_ptr, minp_ptr, floor_ptr, best_ptr,
                 idx_ptr, NS, skip_ptr, FILTER: tl.constexpr, EXACT: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, NS_BLOCK: tl.constexpr, HAS_SKIP: tl.constexpr, NEAR_LOOP: tl.constexpr):
    """Per chunk: the Gumbel-max over the kept set (greedy rows: the argmax). Exact scores only
    for the elements whose fast score is near the chunk's best so far (``triton_gumbel``): up to
    NEAR_LOOP of a block one at a time, more as a vector; a block holding +inf or NaN, and every
    block after it, scores exactly throughout (the exact path's own rules for them)."""
    row, c = tl.program_id(0), tl.program_id(1)
    if HAS_SKIP:
        if tl.load(skip_ptr + row) != 0:  # the row's token is already drawn
            return
    base = logits_ptr + row.to(tl.int64) * stride
    inv_t, greedy = inv_temperature(tl.load(temp_ptr + row))
    rkey = gumbel.row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
    m, minp, floor = row_filters(pmax_ptr, minp_ptr, floor_ptr, row, NS, NS_BLOCK, FILTER)
    offs = tl.arange(0, BLOCK)
    best = tl.full((), _NEG_INF, tl.float32)
    best_i = tl.zeros((), tl.int32)
    fbest = tl.full((), _NEG_INF, tl.float32)  # the best fast score so far
    all_exact = tl.zeros((), tl.int32)
    for off in range(0, CHUNK, BLOCK):
        first = c * CHUNK + off
        idx = first + offs
        valid = idx < V
        x = tl.load(base + idx, mask=valid, other=_NEG_INF).to(tl.float32)
        if greedy:
            bv, bi = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            best, best_i = _running_best(bv, bi, first, best, best_i)
        else:
            s = x * inv_t
            keep = valid
            some = first < V
            if FILTER:
                keep = keep & (key_of(s) >= floor)
                if minp > 0:
                    keep = keep & (exp_(s - m, EXACT) >= minp)
                some = tl.max(keep.to(tl.int32), axis=0) > 0
            if some:  # the noise only where some token is kept
                u = gumbel.uniform(rkey, idx)
                if all_exact != 0:
                    best, best_i = _exact_best(s, u, keep, first, best, best_i, EXACT)
                else:
                    fs = tl.where(keep, s + gumbel.fast(u, EXACT), _NEG_INF)
                    fb = tl.max(tl.where(fs == fs, fs, _POS_INF), axis=0)  # NaN counts as +inf
                    if fb == _POS_INF:
                        all_exact = tl.full((), 1, tl.int32)
                        best, best_i = _exact_best(s, u, keep, first, best, best_i, EXACT)
                    elif (fb > _NEG_INF) & (fb >= fbest - gumbel.near_margin(fbest)):
                        fbest = tl.maximum(fbest, fb)
                        near = fs >= fbest - gumbel.near_margin(fbest)
                        n = tl.sum(near.to(tl.int32), axis=0)
                        if n > NEAR_LOOP:
                            best, best_i = _exact_best(s, u, near, first, best, best_i, EXACT)
                        else:
                            for _ in range(n):  # in index order: the first of equal scores wins
                                j = tl.min(tl.where(near, offs, BLOCK), axis=0)
                                sj = tl.max(tl.where(offs == j, s, _NEG_INF), axis=0)
                                score = sj + gumbel.exact(gumbel.uniform(rkey, first + j), EXACT)
                                better = score > best
                                best = tl.where(better, score, best)
                                best_i = tl.where(better, first + j, best_i)
                                near = near & (offs != j)
    tl.store(best_ptr + row * NS + c, best)
    tl.store(idx_ptr + row * NS + c, best_i)


@triton.jit
def _pick_kernel(best_ptr, idx_ptr, out_ptr, NS, skip_ptr, NS_BLOCK: tl.constexpr, HAS_SKIP: tl.constexpr):
    """The first chunk holding the row's best score (the reference's first-index argmax)."""
    row = tl.program_id(0)
    if HAS_SKIP:
        if tl.load(skip_ptr + row) != 0:
            return
    ns = tl.arange(0, NS_BLOCK)
    b = tl.load(best_ptr + row * NS + ns, mask=ns < NS, other=_NEG_INF)
    first = tl.min(tl.where((b == tl.max(b, axis=0)) & (ns < NS), ns, NS_BLOCK), axis=0)
    first = tl.minimum(first, NS - 1)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * NS + first).to(tl.int64))


@triton.jit
def _argmax_kernel(logits_ptr, stride, V, best_ptr, idx_ptr, NS, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Per chunk: the largest logit and its first index (NaN counts as +inf)."""
    row, c = tl.program_id(0), tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    best = tl.full((), _NEG_INF, tl.float32)
    best_i = tl.zeros((), tl.int32) + c * CHUNK  # a chunk of -inf only: its first index
    for off in range(0, CHUNK, BLOCK):
        idx = c * CHUNK + off + offs
        x = tl.load(base + idx, mask=idx < V, other=_NEG_INF).to(tl.float32)
        x = tl.where(x == x, x, _POS_INF)
        bv, bi = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best, best_i = _running_best(bv, bi, c * CHUNK + off, best, best_i)
    tl.store(best_ptr + row * NS + c, best)
    tl.store(idx_ptr + row * NS + c, best_i)


def argmax(logits: torch.Tensor, chunk: int = 8192, block: int = 4096, num_warps: int = 4) -> torch.Tensor:
    """[R, V] logits -> [R] int64: each row's first largest index, as ``logits.argmax(-1)``
    (which reads a row per program; this reads (rows x chunks) programs: the whole GPU).
    A NaN counts as +inf, so a row holding both picks the first of either. Graph-safe.
    Default launch: the fastest of ``kernel-times small-kernels --argmax-sweep 128`` at 128 x
    151,936 bf16 (docs/PERFORMANCE.md, "Kernel choices")."""
    assert logits.dim() == 2 and chunk % block == 0
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    R, V = logits.shape
    ns = triton.cdiv(V, chunk)
    best = torch.empty(R, ns, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(R, ns, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return tokens
    _argmax_kernel[(R, ns)](logits, logits.stride(0), V, best, best_idx, ns, CHUNK=chunk, BLOCK=block,
                            num_warps=num_warps)
    _pick_kernel[(R,)](best, best_idx, tokens, ns, tokens, NS_BLOCK=max(2, triton.next_power_of_2(ns)), HAS_SKIP=False)
    return tokens


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
           filters: tuple[bool, bool, bool] | bool, chunk: int | None = None, block: int = 1024,
           hist_block: int = 256, search_block: int = 512, pivots: int = 16, cap: int = 4096, num_warps: int = 4,
           finish_warps: int = 8, probe: list | None = None, candidate_first: bool = True,
           near_loop: int = 4) -> torch.Tensor:
    """[R, V] logits (float32, or the model's bf16 / fp16: read as float32, which is exact, so
    the draws equal those of the upcast copy at half the bytes) -> [R] int64 tokens; per-row tensors as in ``sampling.RowParams``
    (temperature / top_p / min_p float32, top_k / seed / position int64).
    ``filters``: whether some row uses (top-k, top-p, min-p); True = all (stages of unused
    filters are skipped; a row's own off values are honoured either way). ``cap``: the
    per-row candidate buffer of the threshold search; ``probe`` (tests) collects each
    stage's row phases. ``chunk``: elements a program reads in a pass; by default 8,192 for a
    draw alone and 2,048 when filters run (the few rows a top-p search is left with spread over
    more programs). ``finish_warps``: the per-row threshold search's. ``candidate_first``: draw first and search top-p thresholds only
    for rows whose draw falls outside the nucleus (``triton_top_p_candidate``; the same tokens).
    ``near_loop``: a draw block scores up to this many near-best elements exactly one by one,
    more as a vector (``_draw_kernel``).
    Defaults: docs/PERFORMANCE.md, "Kernel choices" (python -m benchmarks kernel-times sampler-kernels)."""
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(1) == 1
    assert top_k.dtype == seed.dtype == position.dtype == torch.int64
    assert temperature.dtype == top_p.dtype == min_p.dtype == torch.float32
    R, V = logits.shape
    dev = logits.device
    use_top_k, use_top_p, use_min_p = (filters,) * 3 if isinstance(filters, bool) else filters
    any_filter = use_top_k or use_top_p or use_min_p
    chunk = chunk or (2048 if any_filter else 8192)
    assert chunk % block == 0
    L = StageLaunch(logits, chunk, hist_block, search_block, pivots, cap, num_warps, EXACT_MATH, finish_warps)
    floor = torch.full((R,), KEY_MIN, dtype=torch.int64, device=dev)  # below every key: keep all
    pmax = torch.empty(R, L.ns, dtype=torch.float32, device=dev)
    best = torch.empty(R, L.ns, dtype=torch.float32, device=dev)
    best_idx = torch.empty(R, L.ns, dtype=torch.int32, device=dev)
    tokens = torch.empty(R, dtype=torch.int64, device=dev)

    def draw(floor: torch.Tensor, skip: torch.Tensor | None = None) -> None:
        flag = tokens if skip is None else skip  # an unread pointer when there is no skip
        _draw_kernel[(R, L.ns)](logits, logits.stride(0), V, temperature, seed, position, pmax, min_p, floor, best,
                                best_idx, L.ns, flag, FILTER=any_filter, EXACT=L.exact, CHUNK=chunk, BLOCK=block,
                                NS_BLOCK=L.ns_block, HAS_SKIP=skip is not None, NEAR_LOOP=near_loop,
                                num_warps=num_warps, enable_fp_fusion=False)
        _pick_kernel[(R,)](best, best_idx, tokens, L.ns, flag, NS_BLOCK=L.ns_block, HAS_SKIP=skip is not None)

    if not any_filter:
        draw(floor)
        return tokens
    pmin = torch.empty_like(pmax)
    _stats_kernel[(R, L.ns)](logits, logits.stride(0), V, temperature, pmax, pmin, L.ns, CHUNK=chunk,
                             BLOCK=block, num_warps=num_warps)
    if use_top_k:
        floor = threshold(L, logits, temperature, top_k, top_p, min_p, pmax, pmin, floor, False, probe)
    if use_top_p and candidate_first:
        draw(floor)  # over the top-k and min-p survivors: each row's candidate
        done = candidate_done(logits, temperature, top_p, min_p, pmax, floor, tokens, chunk, block, num_warps,
                              L.exact)
        floor = threshold(L, logits, temperature, top_k, top_p, min_p, pmax, pmin, floor, True, probe, skip=done)
        draw(floor, skip=done)
        return tokens
    if use_top_p:
        floor = threshold(L, logits, temperature, top_k, top_p, min_p, pmax, pmin, floor, True, probe)
    draw(floor)
    return tokens


@triton.jit
def _penalty_kernel(logits_ptr, out_ptr, stride, V, slot_ptr, counts_ptr, pmask_ptr, smask_ptr,
                    pres_ptr, freq_ptr, rep_ptr, sup_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < V
    state = tl.load(slot_ptr + row) * V + idx
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + idx, mask=valid, other=0.0).to(tl.float32)
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
