"""Pieces shared by the Triton paged-attention kernels: the paged K/V tile gather, the prefill
and batch-invariant kernels' key loop (``attend``) and register cap, and launch helpers.

Cache layout (one layer): ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``;
the kernels get ``kv_cache[0]`` / ``kv_cache[1]`` and their strides, head_dim stride 1."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def kv_tile_rows(
    table_ptr,
    n0,
    hi,
    kv_head,
    stride_block,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
):
    """Cache offsets (int64 [BLOCK_N]) of keys ``n0 .. n0 + BLOCK_N - 1`` of one row and KV head,
    for the tile's K and V loads both; ``n0`` a multiple of BLOCK_N. MASK: keys from ``hi`` on get
    block 0's offsets (without it, every key of the tile must be below ``hi``: the table is read
    unmasked). A tile inside one KV block reads one table entry; otherwise
    every key looks up its own block (any power-of-two block size; the repeats hit L1). Loading
    one entry per block and reshaping [blocks, BLOCK_SIZE] offsets to [BLOCK_N] instead was 1.7x
    (prefill) to 4.6x (decode) slower: the reshape's layout change, every tile."""
    if BLOCK_SIZE >= BLOCK_N:
        block = tl.load(table_ptr + n0 // BLOCK_SIZE).to(tl.int64)
        rows = block * stride_block + (n0 % BLOCK_SIZE + tl.arange(0, BLOCK_N)) * stride_slot
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASK:
            block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < hi, other=0)
        else:
            block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE)
        rows = block_ids.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_slot
    return rows + kv_head * stride_head


@triton.jit
def load_kv(cache_ptr, rows, offs_d, n_mask, d_mask):
    """Keys (or values) at ``rows`` (from ``kv_tile_rows``): [BLOCK_N, BLOCK_D]. Masked keys load
    0 and never touch memory: unused slots may hold anything."""
    return tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)


E4M3_PAIRS_ASM = tl.constexpr("""{
.reg .b32 t;
.reg .b16 e, o;
prmt.b32 t, $2, 0, 0x3120;
mov.b32 {e, o}, t;
cvt.rn.f16x2.e4m3x2 $0, e;
cvt.rn.f16x2.e4m3x2 $1, o;
}""")
"""Two int16 lanes (four e4m3 bytes b0..b3, b0 lowest) -> f16x2 (b0, b2) and f16x2 (b1, b3): one byte
permute and one conversion per two values (every e4m3 value is a float16 exactly)."""


@triton.jit
def widen_e4m3_pairs(x, USE_ASM: tl.constexpr):
    """int16 tile, each element two e4m3 bytes of neighbouring dims (the even one low) -> (even, odd)
    float16 tiles of the tile's shape, exact. The CPU interpreter (``USE_ASM=False``) moves e4m3's
    sign, exponent and mantissa into float16's fields (value * 2**-8, subnormals included) and
    scales back."""
    if USE_ASM:
        return tl.inline_asm_elementwise(E4M3_PAIRS_ASM, "=r,=r,r", [x], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=2)
    u = x.to(tl.int32) & 0xFFFF
    even = (((u & 0xFF) + (u & 0x80)) << 7).to(tl.int16).to(tl.float16, bitcast=True)
    odd = ((u & 0x8000) | ((u & 0x7F00) >> 1)).to(tl.int16).to(tl.float16, bitcast=True)
    return even * 256.0, odd * 256.0


@triton.jit
def load_q_pairs(q_rows, row_mask, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, Q_BF16: tl.constexpr):
    """Queries as float16 even / odd dims, each row scaled by a power of two 2**-e that keeps it below
    2**15 (f16's range; e = 0 for any row already inside it: bf16 -> f16 is then exact), and 2**e per
    row to multiply its scores by: the query side of ``widen_e4m3_pairs``' key and value halves.
    ``q_rows``: a pointer a matrix row into the queries viewed as int32 (``q_as_pairs``), each
    element a pair of neighbouring dims (the even one low), bf16 (``Q_BF16``) or float16: whole
    32-bit loads, not strided 16-bit ones."""
    offs_p = tl.arange(0, BLOCK_P)
    mask = row_mask[:, None] & (offs_p < HEAD_DIM // 2)[None, :]
    u = tl.load(q_rows[:, None] + offs_p[None, :], mask=mask, other=0)
    if Q_BF16:  # a bf16 is the top half of its float32
        q_e = (u << 16).to(tl.float32, bitcast=True)
        q_o = (u & -65536).to(tl.float32, bitcast=True)
    else:
        q_e = (u & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        q_o = (u >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(q_e), 1), tl.max(tl.abs(q_o), 1))
    # amax < 2**(biased exponent - 126): a shift of (biased exponent - 141) leaves it below 2**15
    shift = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141, 0)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    return (q_e * down[:, None]).to(tl.float16), (q_o * down[:, None]).to(tl.float16), up


def q_as_pairs(q: torch.Tensor) -> torch.Tensor:
    """16-bit queries [T, H, D] (D even) as int32 [T, H, D / 2], one element a pair of dims, for
    ``load_q_pairs`` (copied first where a stride or the offset is odd)."""
    if q.stride(-1) != 1 or q.storage_offset() % 2 or any(s % 2 for s in q.stride()[:-1]):
        q = q.contiguous()
    return q.view(torch.int32)


@triton.jit
def kv_tile(cache_ptr, kv_ptrs, offs_n, hi, col_mask, MASK: tl.constexpr, EVEN: tl.constexpr, ZERO: tl.constexpr):
    """One K or V tile of ``attend`` / the prefill kernel's e4m3 loop: with MASK (the diagonal tiles)
    keys from ``hi`` on and the columns past the head are ``ZERO`` (0.0 for a float cache, 0 for
    int16 pairs); without it only the columns are masked, and nothing where the head fills the tile
    (EVEN)."""
    if MASK:
        tile = tl.load(cache_ptr + kv_ptrs, mask=(offs_n < hi)[:, None] & col_mask[None, :], other=ZERO)
    elif EVEN:
        tile = tl.load(cache_ptr + kv_ptrs)
    else:
        tile = tl.load(cache_ptr + kv_ptrs, mask=col_mask[None, :], other=ZERO)
    return tile


@triton.jit
def softmax_step(qk, acc, l_i, m_i, offs_n, pos, qk_scale, MASK: tl.constexpr):
    """One key tile of the online softmax (``attend``'s, also the wide prefill kernel's): the tile's
    probabilities, the accumulator rescaled to the new row max, the updated sum and max (log2 units,
    the scale folded into the max subtraction; MASK: the causal mask on the diagonal tiles)."""
    if MASK:  # keys past kv_len are past every query's position too
        qk = tl.where(offs_n[None, :] <= pos[:, None], qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
    else:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    return p, acc * alpha[:, None], l_i * alpha + tl.sum(p, 1), m_ij


@triton.jit
def attend(acc, l_i, m_i, q, pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_d, d_mask,
           lo, hi, qk_scale, stride_cb, stride_cs, stride_ch,
           BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr,
           DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update of the tile's queries (q [M, D], positions ``pos``) with keys
    [lo, hi) of its row and KV head, BLOCK_N at a time, scores in log2 units, as FlashAttention
    does it: the scale folded into the max subtraction (one FMA a score), the rescaled
    accumulator fed to the P @ V dot as its addend. MASK (the tiles on the diagonal): the causal
    mask (every query sees key 0, so its max is finite from the first tile on and a masked
    score's exp2 is 0; a padding row's may go NaN: rows never mix, and it is not stored); without
    it no load is masked (whole tiles below every query's position: live pages only). The prefill
    kernel's loop; the batch-invariant kernel builds it without FMA contraction (both branches
    then round a visible key's score alike: max(qk) x scale == max(qk x scale), rounding being
    monotone)."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows = kv_tile_rows(table_ptr, n0, hi, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, BLOCK_N, MASK)
        kv_ptrs = rows[:, None] + offs_d[None, :]
        k = kv_tile(k_cache_ptr, kv_ptrs, offs_n, hi, d_mask, MASK, EVEN_D, 0.0)
        qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        p, acc, l_i, m_ij = softmax_step(qk, acc, l_i, m_i, offs_n, pos, qk_scale, MASK)
        v = kv_tile(v_cache_ptr, kv_ptrs, offs_n, hi, d_mask, MASK, EVEN_D, 0.0)
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


CAPPED_HEAD_DIM = 128
"""The widest head an attention launch capped at 128 registers a thread holds (``max_registers``,
``HOPPER_LONG``, the batch-invariant kernel's 128-row tiles): a wider accumulator alone would take
the cap (at head_dim 256 ptxas refuses the long tiles)."""


def max_registers(head_dim: int, device: torch.device) -> int | None:
    """Registers per thread the compiler may use (None: its choice). Capped at 128 for 64-row
    tiles of 32 keys and head_dim <= ``CAPPED_HEAD_DIM``, four programs fit an H100 SM instead of
    two (its choice: 232 registers): 1.2x on a 30B-A3B / 8B / 0.6B-shaped mixed step of 8,192
    tokens (``kernel-times paged-attention --sweep-prefill``). Larger heads keep the compiler's
    choice."""
    return 128 if device.type == "cuda" and head_dim <= CAPPED_HEAD_DIM else None


TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_args(kernel: object, cache_dtype: torch.dtype, q_dtype: torch.dtype | None = None) -> dict[str, object]:
    """Constexprs DOT_DTYPE (operand type of every ``tl.dot``) and DOT_PRECISION.

    Operands are fed in the cache dtype (tensor cores for bf16/fp16); fp32 must not be
    rounded to tf32, the reference is exact fp32. An e4m3 cache computes in the queries'
    dtype ``q_dtype`` (e4m3 widens to it exactly). Triton's CPU interpreter multiplies
    bf16 as raw uint16 bits, so there bf16 operands are widened to fp32 first."""
    if cache_dtype == torch.float8_e4m3fn and q_dtype is not None:
        cache_dtype = q_dtype
    if cache_dtype not in TL_DTYPES:
        raise TypeError(f"unsupported KV cache dtype {cache_dtype}")
    dot_dtype = TL_DTYPES[cache_dtype]
    if cache_dtype == torch.bfloat16 and isinstance(kernel, InterpretedFunction):
        dot_dtype = tl.float32
    return {"DOT_DTYPE": dot_dtype, "DOT_PRECISION": "ieee" if dot_dtype == tl.float32 else "tf32"}


def kv_scale_args(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None,
                  unused: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the kernels' ``kv_scale_ptr``, their KV_FP8 constexpr): an e4m3 cache needs its layer's
    scales [2, KVH] float32 (keys, values; powers of two); other caches pass ``unused`` (never read)."""
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if fp8 and (kv_scale is None or tuple(kv_scale.shape) != (2, kv_cache.shape[3])
                or kv_scale.dtype != torch.float32 or not kv_scale.is_contiguous()):
        raise ValueError(f"an e4m3 KV cache needs kv_scale [2, {kv_cache.shape[3]}] float32, got "
                         f"{None if kv_scale is None else (tuple(kv_scale.shape), kv_scale.dtype)}")
    return (kv_scale if fp8 else unused), fp8


def check_cache(kv_cache: torch.Tensor, q: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("kv_cache and q need a contiguous head_dim")
    if q.shape[1] % kv_cache.shape[3] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {kv_cache.shape[3]} KV heads")


@functools.lru_cache(maxsize=None)
def num_compute_units(device: torch.device) -> int:
    """SM count on CUDA; a small stand-in on CPU (interpreter) so split-K still happens there."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
