"""What the prefill kernels share: a program's query rows (``tile_queries``), its key ranges and
its output store, and the choice of launch (``prefill_launch``: tiles, warps, stages, register
cap and kernel variant), with what a launch may shrink to where the device does not hold it.

Kernel variants (``PrefillLaunch.kernel``): "pointer" (``triton_prefill_attention``'s kernel: any
head_dim, float32 / 16-bit / e4m3 caches), "wide" and "tma" (``triton_prefill_wide``: 16-bit caches, a
power-of-two head_dim; "tma" pages of at least BLOCK_N tokens)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from megatron_async.kernels import launch_limits
from megatron_async.kernels.triton_fp8_act import store_heads_quantized
from megatron_async.kernels.triton_paged_common import CAPPED_HEAD_DIM, max_registers


@triton.jit
def key_ranges(kv_len, pos, m_valid, BLOCK_N: tl.constexpr):
    """(end of the keys every query of the tile sees, end of the keys any query sees): the first
    range runs unmasked, whole tiles only, the rest with the causal mask."""
    # Keys below every query's position (and kv_len) need no mask; the rest do.
    no_mask_end = tl.minimum(kv_len, tl.min(tl.where(m_valid, pos, kv_len), 0) + 1)
    no_mask_end = no_mask_end // BLOCK_N * BLOCK_N  # whole tiles only: the unmasked pass has no tail mask
    end = tl.minimum(kv_len, tl.max(pos, 0) + 1)
    return no_mask_end, end


@triton.jit
def tile_queries(entry, kv_head, cu_q_ptr, positions_ptr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_Q: tl.constexpr):
    """A schedule entry's matrix rows: (row, token, query head, valid, position) of each (token,
    head-in-group) pair of the tile's BLOCK_Q * BLOCK_G rows."""
    row = (entry >> 32).to(tl.int32)
    q_first = (entry & 0x7FFFFFFF).to(tl.int32)  # first query of the tile, within the row
    q_begin = tl.load(cu_q_ptr + row)
    q_len = tl.load(cu_q_ptr + row + 1) - q_begin
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_idx = q_first + offs_m // BLOCK_G
    g = offs_m % BLOCK_G
    m_valid = (q_idx < q_len) & (g < GROUP)
    tok = (q_begin + q_idx).to(tl.int64)
    pos = tl.load(positions_ptr + tok, mask=m_valid, other=-1).to(tl.int32)
    return row, tok, kv_head * GROUP + g, m_valid, pos


@triton.jit
def store_output(o, tok, heads, m_valid, out_ptr, stride_ot, stride_oh, oq_ptr, os_ptr, rows_padded, width,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUANT_OUT: tl.constexpr, EMULATE: tl.constexpr):
    """The tile's normalised output rows (token ``tok``, head ``heads`` each): stored in the output's
    dtype, or with ``QUANT_OUT`` quantized for an FP8 o projection (each row one 128-wide group of
    its [T, width] input, ``store_heads_quantized``)."""
    if QUANT_OUT:
        store_heads_quantized(o, tok, heads, m_valid, oq_ptr, os_ptr, rows_padded, width, out_ptr.dtype.element_ty,
                              EMULATE)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])


def prefill_tiles(group: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N): ~64 matrix rows per program on GPU (one warpgroup's wgmma tile), 32 keys
    per tile (see ``max_registers``); small tiles on CPU so tiny test shapes still cross tile
    boundaries. 128 x 64 tiles on 8 warps, 3 stages (one program an SM at the compiler's ~180
    registers, against four at the cap) ran 1.4x slower on workload A's mixed step
    (``kernel-times paged-attention --sweep-prefill``)."""
    block_g = max(1, triton.next_power_of_2(group))
    rows = 16 if device.type == "cpu" else 64
    return max(1, rows // block_g), 16 if device.type == "cpu" else 32


def prefill_fallbacks(block_g: int) -> list[tuple[int, int]]:
    """(rows, keys) a launch may shrink to where the device does not hold its tiles: 16-key tiles,
    then fewer query tokens (down to the 16 rows ``tl.dot`` needs)."""
    rows = [r for r in (64, 32, 16) if r >= block_g]
    return [(r, n) for r in rows for n in (32, 16)]


NUM_WARPS, NUM_STAGES = 4, 2
"""The default launch's warps (one warpgroup) and pipeline stages (cp.async of the next K / V tile)."""

KERNELS = ("pointer", "wide", "tma")


class PrefillLaunch(NamedTuple):
    """One launch of a prefill kernel."""
    rows: int
    """Matrix rows a program: query tokens x the group's heads (padded to a power of two)."""
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int
    """Registers a thread may use; 0: the compiler's choice."""
    kernel: str = "pointer"
    warp_specialize: bool = False
    """Warp-specialize the wide kernels' unmasked loop (``tl.range(warp_specialize=True)``)."""


HOPPER_LONG = PrefillLaunch(128, 64, 8, 3, 128)
"""128 x 64 tiles on two warpgroups, 3 stages, 128 registers a thread (two programs an SM; uncapped,
the compiler's ~180 left one and ran 0.7x). On an H100 (``kernel-times prefill-attention``) 466-491
TFLOP/s on an 8k-token prompt and 365-397 on 4 x 2k against the default's 404-411 and 344-354, but
138-197 against 150-208 on 8 x 1k prompts beside 64 decode rows. A step runs it when its longest
row reaches ``LONG_TILE_MIN_QUERY`` tokens (``AttentionMetadata.long_tiles``, chosen by the host and
a graph variant of its own: ``GraphKey.long_tiles``); giving it only the long rows in a second launch
cost long prompts 6 % a prefill step: the decode rows' memory-bound tiles no longer overlapped the
prompt's (docs/PERFORMANCE.md)."""

LONG_TILE_MIN_QUERY = 2048
"""Query tokens of a step's longest row from which the step runs ``HOPPER_LONG``: at 4 x 2k rows it ran
365-397 TFLOP/s against the default's 344-354 (H100), at 8 x 1k beside 64 decode rows 138-197 against
150-208, so rows of 2k tokens are the shortest measured where the long tiles win."""


def long_tiles_pay(device: torch.device) -> bool:
    """Whether ``HOPPER_LONG`` was measured faster on ``device``: Hopper (sm90); on CPU (the
    interpreter) for tests. Elsewhere steps keep the default launch."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def prefill_launch(group: int, head_dim: int, block_size: int, device: torch.device,
                   long: bool = False) -> PrefillLaunch:
    """The default launch for a GQA group of ``group`` query heads a KV head, ``head_dim`` and pages of
    ``block_size`` tokens: the one place to change after measuring (``kernel-times prefill-attention``).
    ``long``: a step with a row of ``LONG_TILE_MIN_QUERY``+ tokens (``HOPPER_LONG``, up to
    ``CAPPED_HEAD_DIM``: its 128-register cap)."""
    if long and head_dim <= CAPPED_HEAD_DIM:
        return HOPPER_LONG
    block_q, block_n = prefill_tiles(group, device)
    block_g = max(1, triton.next_power_of_2(group))
    return PrefillLaunch(block_q * block_g, block_n, NUM_WARPS, NUM_STAGES, max_registers(head_dim, device) or 0)


def unusable(launch: PrefillLaunch, head_dim: int, block_size: int, fp8: bool) -> str | None:
    """Why ``launch``'s kernel cannot run this call (None: it can)."""
    if launch.kernel not in KERNELS:
        return f"unknown prefill kernel {launch.kernel!r} (one of {KERNELS})"
    if launch.kernel == "pointer":
        return None
    if fp8:
        return f"the {launch.kernel} prefill kernel reads 16-bit caches only (an e4m3 cache: the pointer kernel)"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"the {launch.kernel} prefill kernel needs a power-of-two head_dim >= 16, got {head_dim}"
    if launch.kernel == "tma" and block_size < launch.block_n:
        return f"TMA tiles of {launch.block_n} keys need pages of at least as many tokens, got {block_size}"
    return None


def fitted_launch(launch: PrefillLaunch, block_g: int, block_d: int, q_bytes: int, kv_bytes: int,
                  limits: launch_limits.DeviceLimits) -> PrefillLaunch:
    """``launch`` as the device holds it (``launch_limits.attention_tiles``: fewer stages, then smaller
    tiles of ``prefill_fallbacks``), its rows at least the 16 ``tl.dot`` needs."""
    rows = max(launch.rows, 16, block_g)
    rows, block_n, stages = launch_limits.attention_tiles(rows, launch.block_n, block_d, launch.num_stages,
                                                          launch.num_warps, q_bytes, kv_bytes, limits,
                                                          prefill_fallbacks(block_g))
    return launch._replace(rows=rows, block_n=block_n, num_stages=stages)
