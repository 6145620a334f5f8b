"""Per-element and per-row pieces shared by the sort-free sampler's kernels (the threshold search,
the top-p candidates, the draws and the log-probs): exact or fast exp and log, int32 keys that
order float32 scores, a row's inverse temperature, max and filters, and an element's key, weight
and whether it is in play."""
from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

EXACT_MATH = os.environ.get("TRITON_INTERPRET", "0") != "1"
"""The kernels' ``EXACT`` argument: libdevice's correctly rounded math on CUDA; the interpreter
(CPU tests) has only numpy's."""
_NEG_INF = tl.constexpr(float("-inf"))
_GREEDY = tl.constexpr(1e-5)  # sampling.GREEDY_TEMPERATURE


@triton.jit
def exp_(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log_(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def fast_log(x, EXACT: tl.constexpr):
    """The hardware's approximate log (lg2.approx) on CUDA; the interpreter's log."""
    if EXACT:
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def key_of(s):
    """float32 -> int32 key with the same order (-0 == +0)."""
    s = tl.where(s == 0.0, 0.0, s)
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def value_of(k):
    """int32 key -> its float32."""
    b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def inv_temperature(t):
    """sampling.inverse_temperature for one row: (1 / t rounded to nearest, greedy)."""
    greedy = t < _GREEDY
    return tl.math.div_rn(1.0, tl.where(greedy, 1.0, t)), greedy


@triton.jit
def row_max(pmax_ptr, row, NS, NS_BLOCK: tl.constexpr):
    ns = tl.arange(0, NS_BLOCK)
    return tl.max(tl.load(pmax_ptr + row * NS + ns, mask=ns < NS, other=_NEG_INF), axis=0)


@triton.jit
def row_filters(pmax_ptr, minp_ptr, floor_ptr, row, NS, NS_BLOCK: tl.constexpr, USED: tl.constexpr):
    """(row max of s, min-p, key floor) where a filter is applied, else zeros."""
    if USED:
        return row_max(pmax_ptr, row, NS, NS_BLOCK), tl.load(minp_ptr + row), tl.load(floor_ptr + row)
    else:
        return 0.0, 0.0, 0


@triton.jit
def weight_halves(w):
    """A fixed-point weight (an integer <= 2**32 held exactly in float32) as int32 (hi, lo), w =
    2**16 hi + lo, each <= 2**16: sums of many of them stay exact in int32."""
    hi = tl.floor(w * (1.0 / 65536.0))
    return hi.to(tl.int32), (w - hi * 65536.0).to(tl.int32)


@triton.jit
def element(x, valid, inv_t, m, minp, floor, MASS: tl.constexpr, EXACT: tl.constexpr):
    """-> (s, key, fixed-point weight as float32, in play). Top-k counts every element but
    -inf ones (grammar masks and bans: a plateau of 10^5 equal keys that no bucket splits, which
    sent every masked row to the whole-row search; they are never drawn, so the tokens stay the
    reference's); top-p weighs the min-p and top-k survivors (zero weights never move the boundary)."""
    s = x * inv_t
    key = key_of(s)
    if MASS:
        e = exp_(s - m, EXACT)
        w = tl.floor(e * 4294967296.0)
        play = valid & (key >= floor) & (e >= minp) & (w > 0.0)
    else:
        w = tl.full(s.shape, 1.0, tl.float32)
        play = valid & (s != _NEG_INF)
    return s, key, w, play
