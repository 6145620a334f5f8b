"""Log-probabilities of the raw logits without a [R, V] float32 copy or [R, V] sort keys.

``sampling.log_probs_of`` is the definition; this computes the same values from the logits
in their own dtype (bf16 / fp16 read as float32 in registers, which is exact), always with
the top ``MAX_TOP_N`` (a smaller n is their head: one kernel build serves every step):
- a (rows x chunks) stats pass: per chunk, the max and the sum of ``exp(x - max)`` (an online
  log-sum-exp), and the best sort key of every group of ``GROUP`` logits;
- a per-row pass takes the n-th best group maximum, a bound at or below the row's n-th best
  key (n groups hold a key at least that large); a (rows x chunks) pass then reads only the
  chunks with a group at or above the bound and extracts their best keys among the few
  logits at or above it (typically about n per row in all);
- a per-row pass: the log-sum-exp from the chunks (in chunk order: a row's value does not
  depend on the batch), the chosen token's ``x - lse``, and the n best of the chunks' keys.
A sort key is ``top_ids_lowest_first``'s int64: the value's order-preserving float32 bits
above the inverted id, so the ids are exactly the reference's (ties to the lowest id, -0 ==
+0); the reported values are ``x[id] - lse``.
Batch-invariant mode keeps the reference's values bit for bit: the log-sum-exp is
``triton_log_softmax.row_lse`` of the logits as given (the reference's too: on CUDA its bits
depend on the input dtype), and the keys are those of ``x - lse``. Shapes come from tensor
metadata, nothing syncs: CUDA-graph safe."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_async.kernels import triton_log_softmax
from megatron_async.kernels.triton_sampling_common import EXACT_MATH, exp_, key_of, log_

MAX_TOP_N = 20
"""The kernels always compute this many top entries (a smaller n is their head), so the one
build that warm-up makes (the log-prob graphs' top-20) serves every step; beyond it the torch
reference answers (graphs run no such step)."""
GROUP = 128
"""Logits per group maximum of the top-n bound."""
_NEG_INF = tl.constexpr(float("-inf"))
_POS_INF = tl.constexpr(float("inf"))
_NO_KEY = tl.constexpr(-(2**63))  # below every key
_NO_KEY32 = tl.constexpr(-(2**31))  # at or below every value key


@triton.jit
def _shifted(x_ptr, stride, V, lse_ptr, row, idx, SHIFT: tl.constexpr):
    """The logits at idx as float32 (-inf past V), minus the row's lse when SHIFT."""
    x = tl.load(x_ptr + row.to(tl.int64) * stride + idx, mask=idx < V, other=_NEG_INF).to(tl.float32)
    if SHIFT:
        x = x - tl.load(lse_ptr + row)
    return x


@triton.jit
def _stats_kernel(x_ptr, stride, V, lse_ptr, pmax_ptr, psum_ptr, gmax_ptr, NS, NG, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr, GROUP: tl.constexpr, STATS: tl.constexpr, SHIFT: tl.constexpr,
                  EXACT: tl.constexpr):
    """Per chunk: max and sum of exp(x - max) (STATS), and each group's best value key (of
    x - lse when SHIFT)."""
    row, c = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = tl.full((), _NEG_INF, tl.float32)
    s = tl.zeros((), tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = c * CHUNK + off + offs
        x = _shifted(x_ptr, stride, V, lse_ptr, row, idx, SHIFT)
        if STATS:
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_use = tl.where(m_new == _NEG_INF, 0.0, m_new)  # only -inf so far: the sum stays 0
            s = s * exp_(m - m_use, EXACT) + tl.sum(exp_(x - m_use, EXACT), axis=0)
            m = m_new
        k = tl.where(idx < V, key_of(x), _NO_KEY32)
        g = (c * CHUNK + off) // GROUP + tl.arange(0, BLOCK // GROUP)
        tl.store(gmax_ptr + row * NG + g, tl.max(tl.reshape(k, (BLOCK // GROUP, GROUP)), axis=1), mask=g < NG)
    if STATS:
        tl.store(pmax_ptr + row * NS + c, m)
        tl.store(psum_ptr + row * NS + c, s)


@triton.jit
def _bound_kernel(gmax_ptr, bound_ptr, NG, TOP_N: tl.constexpr, NG_BLOCK: tl.constexpr):
    """Per row: the TOP_N-th best group maximum (the lowest key when fewer groups)."""
    row = tl.program_id(0)
    g = tl.arange(0, NG_BLOCK)
    k = tl.load(gmax_ptr + row * NG + g, mask=g < NG, other=_NO_KEY32)
    best = tl.full((), _NO_KEY32, tl.int32)
    for t in tl.static_range(TOP_N):
        best, i = tl.max(k, axis=0, return_indices=True, return_indices_tie_break_left=True)
        k = tl.where(g == i, _NO_KEY32, k)
    tl.store(bound_ptr + row, best)


@triton.jit
def _top_kernel(x_ptr, stride, V, lse_ptr, gmax_ptr, bound_ptr, key_ptr, NS, NG, CHUNK: tl.constexpr,
                GROUP: tl.constexpr, TOP_N: tl.constexpr, TOP_BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    """Per chunk: its TOP_N best keys among the logits at or above the row's bound (the rest
    _NO_KEY); a chunk whose groups are all below the bound reads no logits."""
    row, c = tl.program_id(0), tl.program_id(1)
    bound = tl.load(bound_ptr + row)
    g = c * (CHUNK // GROUP) + tl.arange(0, CHUNK // GROUP)
    t_idx = tl.arange(0, TOP_BLOCK)
    out = tl.full((TOP_BLOCK,), _NO_KEY, tl.int64)
    if tl.max(tl.load(gmax_ptr + row * NG + g, mask=g < NG, other=_NO_KEY32), axis=0) >= bound:
        idx = c * CHUNK + tl.arange(0, CHUNK)
        k32 = key_of(_shifted(x_ptr, stride, V, lse_ptr, row, idx, SHIFT))
        keys = tl.where((idx < V) & (k32 >= bound), (k32.to(tl.int64) << 32) | (V - 1 - idx).to(tl.int64), _NO_KEY)
        k = tl.max(keys, axis=0)
        t = tl.zeros((), tl.int32)
        while (t < TOP_N) & (k != _NO_KEY):
            out = tl.where(t_idx == t, k, out)
            keys = tl.where(keys == k, _NO_KEY, keys)
            k = tl.max(keys, axis=0)
            t += 1
    tl.store(key_ptr + (row * NS + c).to(tl.int64) * TOP_N + t_idx, out, mask=t_idx < TOP_N)


@triton.jit
def _row_kernel(x_ptr, stride, V, tok_ptr, lse_ptr, pmax_ptr, psum_ptr, key_ptr, chosen_ptr, top_val_ptr,
                top_id_ptr, NS, NS_BLOCK: tl.constexpr, TOP_N: tl.constexpr, KEY_BLOCK: tl.constexpr,
                SHIFT: tl.constexpr, EXACT: tl.constexpr):
    """Per row: lse (from the chunks unless SHIFT: given), the TOP_N best keys, chosen x - lse
    (a token < 0: the row's best id, written back)."""
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    if SHIFT:
        lse = tl.load(lse_ptr + row)
    else:
        ns = tl.arange(0, NS_BLOCK)
        pm = tl.load(pmax_ptr + row * NS + ns, mask=ns < NS, other=_NEG_INF)
        ps = tl.load(psum_ptr + row * NS + ns, mask=ns < NS, other=0.0)
        m = tl.max(pm, axis=0)
        m_use = tl.where((m == _NEG_INF) | (m == _POS_INF), 0.0, m)
        lse = m_use + log_(tl.sum(ps * exp_(pm - m_use, EXACT), axis=0), EXACT)
        lse = tl.where(m == _POS_INF, _POS_INF, lse)  # as torch.logsumexp
    j = tl.arange(0, KEY_BLOCK)
    keys = tl.load(key_ptr + row.to(tl.int64) * NS * TOP_N + j, mask=j < NS * TOP_N, other=_NO_KEY)
    best = tl.zeros((), tl.int64)
    for t in tl.static_range(TOP_N):
        k = tl.max(keys, axis=0)
        keys = tl.where(keys == k, _NO_KEY, keys)
        idx = V - 1 - (k - ((k >> 32) << 32))  # the low 32 bits hold V - 1 - id
        if t == 0:
            best = idx
        tl.store(top_id_ptr + row * TOP_N + t, idx)
        tl.store(top_val_ptr + row * TOP_N + t, tl.load(base + idx).to(tl.float32) - lse)
    tok = tl.load(tok_ptr + row)
    if tok < 0:  # a greedy row: its first largest logit (keys tie to the lowest id, -0 == +0)
        tok = best
        tl.store(tok_ptr + row, tok)
    tl.store(chosen_ptr + row, tl.load(base + tok).to(tl.float32) - lse)


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def log_probs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int, batch_invariant: bool = False,
              chunk: int = 4096, num_warps: int = 8):
    """``sampling.log_probs_of`` for [R, V] logits (float32, bf16 or fp16) and [R] int64 tokens:
    (chosen [R] float32, top values [R, n] float32, top ids [R, n] int64), or (chosen, None,
    None) when top_n is 0 (views of the top ``MAX_TOP_N`` lists). ``top_n`` <= ``MAX_TOP_N``;
    ``chunk`` a multiple of ``GROUP``. A token < 0 asks for the row's greedy token (the
    first index of its largest logit, as ``argmax``), written into ``tokens``: a greedy step
    then reads its logits once for both (not in batch-invariant mode, whose keys order
    ``x - lse``, where rounding can tie logits that argmax separates).
    ``python -m benchmarks kernel-times log-probs --sweep`` times the launch settings against each other."""
    assert logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert tokens.dtype == torch.int64 and 0 <= top_n <= min(MAX_TOP_N, logits.shape[1]) and chunk % GROUP == 0
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    R, V = logits.shape
    dev = logits.device
    n = min(MAX_TOP_N, V)
    ns, ng = triton.cdiv(V, chunk), triton.cdiv(V, GROUP)
    chosen = torch.empty(R, dtype=torch.float32, device=dev)
    top_vals = torch.empty(R, n, dtype=torch.float32, device=dev)
    top_ids = torch.empty(R, n, dtype=torch.int64, device=dev)
    if R > 0:
        lse = triton_log_softmax.row_lse(logits) if batch_invariant else chosen  # chosen: an unread pointer
        pmax = torch.empty(R, ns, dtype=torch.float32, device=dev)
        psum = torch.empty_like(pmax)
        gmax = torch.empty(R, ng, dtype=torch.int32, device=dev)
        bound = torch.empty(R, dtype=torch.int32, device=dev)
        keys = torch.empty(R, ns, n, dtype=torch.int64, device=dev)
        _stats_kernel[(R, ns)](logits, logits.stride(0), V, lse, pmax, psum, gmax, ns, ng, CHUNK=chunk,
                               BLOCK=min(chunk, 4096), GROUP=GROUP, STATS=not batch_invariant,
                               SHIFT=batch_invariant, EXACT=EXACT_MATH, num_warps=num_warps)
        _bound_kernel[(R,)](gmax, bound, ng, TOP_N=n, NG_BLOCK=_pow2(ng), num_warps=4)
        _top_kernel[(R, ns)](logits, logits.stride(0), V, lse, gmax, bound, keys, ns, ng, CHUNK=chunk, GROUP=GROUP,
                             TOP_N=n, TOP_BLOCK=_pow2(n), SHIFT=batch_invariant, num_warps=num_warps)
        _row_kernel[(R,)](logits, logits.stride(0), V, tokens, lse, pmax, psum, keys, chosen, top_vals, top_ids, ns,
                          NS_BLOCK=_pow2(ns), TOP_N=n, KEY_BLOCK=_pow2(ns * n), SHIFT=batch_invariant, EXACT=EXACT_MATH,
                          num_warps=4)
    if top_n == 0:
        return chosen, None, None
    return chosen, top_vals[:, :top_n], top_ids[:, :top_n]
