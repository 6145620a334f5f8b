"""Top-p by drawing first and checking after: most rows need no threshold search.

The sampler's token is the Gumbel-max over the kept set (``triton_sampling``). A draw over the
top-k and min-p survivors (top-p not applied) gives a candidate c. When c is in the top-p nucleus it is also
the draw over the nucleus: the nucleus is a subset, c maximises the same scores over the
superset, and the first-index tie rule carries over. Membership needs one pass: the threshold
is the largest key x with W(key >= x) >= target (W: the fixed-point masses of
``triton_sampling_common.element``, integer-valued float64 sums, exact in any order; target: p x the
survivors' mass, computed as the search computes it), so c is kept iff W(key > key_c) < target.

A Gumbel-max draw follows softmax, so c falls in the nucleus with probability >= p: at p = 0.95
about one row in twenty takes the threshold search and the second draw, whose programs exit at
once for the rows already done. Fixed launches, no host read: graph-safe."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels.triton_sampling_common import element, inv_temperature, key_of, row_max, weight_halves


@triton.jit
def _active(p_ptr, temp_ptr, row):
    """Whether the row's top-p binds (as ``_stage_init_kernel`` decides it)."""
    p = tl.load(p_ptr + row)
    _inv_t, greedy = inv_temperature(tl.load(temp_ptr + row))
    return (p > 0) & (p < 1) & (greedy == 0), p


@triton.jit
def _wide(hi, lo):
    """The exact float64 sum of 2**16 hi + lo over the lanes (integers: exact in any order)."""
    return tl.sum(hi, axis=0).to(tl.float64) * 65536.0 + tl.sum(lo, axis=0).to(tl.float64)


@triton.jit
def _candidate_mass_kernel(logits_ptr, stride, V, temp_ptr, p_ptr, pmax_ptr, NS, minp_ptr, floor_ptr, cand_ptr,
                           part_tot_ptr, part_above_ptr, EXACT: tl.constexpr, CHUNK: tl.constexpr,
                           BLOCK: tl.constexpr, NS_BLOCK: tl.constexpr):
    """Per chunk: the survivors' mass and the mass strictly above the candidate's key."""
    row, c = tl.program_id(0), tl.program_id(1)
    active, _p = _active(p_ptr, temp_ptr, row)
    if active:
        base = logits_ptr + row.to(tl.int64) * stride
        inv_t, _greedy = inv_temperature(tl.load(temp_ptr + row))
        m = row_max(pmax_ptr, row, NS, NS_BLOCK)
        minp = tl.load(minp_ptr + row)
        floor = tl.load(floor_ptr + row)  # the top-k threshold (the lowest key without top-k)
        key_c = key_of(tl.load(base + tl.load(cand_ptr + row)).to(tl.float32) * inv_t)
        offs = tl.arange(0, BLOCK)
        # each weight's halves summed per lane in int32 and across lanes once a chunk (<= 2**14
        # elements of <= 2**16: < 2**31, no overflow)
        tot_hi = tl.zeros((BLOCK,), tl.int32)
        tot_lo = tl.zeros((BLOCK,), tl.int32)
        up_hi = tl.zeros((BLOCK,), tl.int32)
        up_lo = tl.zeros((BLOCK,), tl.int32)
        for off in range(0, CHUNK, BLOCK):
            idx = c * CHUNK + off + offs
            valid = idx < V
            x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
            _s, key, w, play = element(x, valid, inv_t, m, minp, floor, True, EXACT)
            hi, lo = weight_halves(tl.where(play, w, 0.0))
            up = key > key_c
            tot_hi += hi
            tot_lo += lo
            up_hi += tl.where(up, hi, 0)
            up_lo += tl.where(up, lo, 0)
        tl.store(part_tot_ptr + row * NS + c, _wide(tot_hi, tot_lo))
        tl.store(part_above_ptr + row * NS + c, _wide(up_hi, up_lo))


@triton.jit
def _candidate_decide_kernel(temp_ptr, p_ptr, part_tot_ptr, part_above_ptr, NS, done_ptr,
                             NS_BLOCK: tl.constexpr):
    """done[row] = 1 where the candidate stands (top-p does not bind, or it keeps c)."""
    row = tl.program_id(0)
    active, p = _active(p_ptr, temp_ptr, row)
    done = 1
    if active:
        ns = tl.arange(0, NS_BLOCK)
        tot = tl.sum(tl.load(part_tot_ptr + row * NS + ns, mask=ns < NS, other=0.0), axis=0)
        above = tl.sum(tl.load(part_above_ptr + row * NS + ns, mask=ns < NS, other=0.0), axis=0)
        target = p.to(tl.float64) * (tl.zeros((), tl.float64) + tot)  # as _level_update_kernel: p x (0 + total)
        done = (above < target).to(tl.int32)
    tl.store(done_ptr + row, done)


def candidate_done(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   pmax: torch.Tensor, floor: torch.Tensor, candidate: torch.Tensor, chunk: int, block: int,
                   num_warps: int, exact: bool) -> torch.Tensor:
    """[R] int32: 1 where ``candidate`` (the draw over the keys >= ``floor`` [R] int64 and min-p)
    is the row's top-p draw."""
    R, V = logits.shape
    ns = pmax.shape[1]
    ns_block = triton.next_power_of_2(ns)
    part_tot = torch.empty(R, ns, dtype=torch.float64, device=logits.device)  # written and read for active rows only
    part_above = torch.empty_like(part_tot)
    _candidate_mass_kernel[(R, ns)](logits, logits.stride(0), V, temperature, top_p, pmax, ns, min_p, floor, candidate,
                                    part_tot, part_above, EXACT=exact, CHUNK=chunk, BLOCK=block,
                                    NS_BLOCK=ns_block, num_warps=num_warps, enable_fp_fusion=False)
    done = torch.empty(R, dtype=torch.int32, device=logits.device)
    _candidate_decide_kernel[(R,)](temperature, top_p, part_tot, part_above, ns, done, NS_BLOCK=ns_block)
    return done
