"""How many key splits the decode attention runs (``triton_decode_attention``): a function of the
step's shapes only, so a CUDA graph captured at a batch size replays with its capture's split."""
from __future__ import annotations

from fractions import Fraction

import torch
import triton

from megatron_async.kernels.triton_paged_common import num_compute_units

_MAX_SPLITS = 64
_MIN_TOKENS_PER_SPLIT = 128
"""Fewer keys per split than this is not worth a program plus its share of the merge."""


def choose_num_splits(num_rows: int, num_kv_heads: int, max_blocks_per_row: int, block_size: int,
                      device: torch.device) -> int:
    """Split count for a decode step, from shapes only (graph-safe, see the module docstring).
    A step whose rows x KV heads come within 10 % of two programs an SM (the kernel's residency)
    keeps one split: 256 programs on 132 SMs ran 4-25 % faster unsplit, without the merge kernel,
    and 248 (124 rows of a TP=4 rank's two KV heads) 34.4 against 36.4 us split in two. Below
    that, of the split counts from the fewest that reach 90 % of one fill up to twice the count
    that fills it once, capped so a full-length row (the block table's width) keeps
    >= _MIN_TOKENS_PER_SPLIT keys a split, the fewest whose last wave of programs is within 5 %
    of the fullest (``_wave_fill``). A partly filled last wave costs a whole wave: 16 rows x 8 KV
    heads on an H200 took 86 us split three ways (384 programs on 264 places) and 75 split two
    ways, 20 rows 115 / 94 (two / three ways), 12 rows of 16k keys 288 / 201 (three / five ways);
    and every split past those a wave needs costs its program and its share of the merge: 8 rows
    of a TP=4 rank's two KV heads, 100-1,152 keys, 16.3 us on 33 splits, 10.2 on 10
    (``kernel-times decode-splits``, docs/PERFORMANCE.md)."""
    programs, fill = max(1, num_rows * num_kv_heads), 2 * num_compute_units(device)
    if programs >= 0.9 * fill:
        return 1
    cap = min(triton.cdiv(max_blocks_per_row * block_size, _MIN_TOKENS_PER_SPLIT), _MAX_SPLITS)
    lo = max(2, triton.cdiv(9 * fill, 10 * programs))
    if cap <= lo:
        return max(1, cap)
    counts = range(lo, min(2 * triton.cdiv(fill, programs), cap) + 1)
    best = max(_wave_fill(programs * s, fill) for s in counts)
    return min(s for s in counts if _wave_fill(programs * s, fill) >= best - Fraction(1, 20))


def _wave_fill(programs: int, places: int) -> Fraction:
    """The share of the programs' waves (``places`` programs each) that holds a program."""
    return Fraction(programs, places * triton.cdiv(programs, places))


MIXED_SPLIT_KEYS = 2048
"""Keys a split holds at most for the decode rows of a long-tile step (``mixed_step_splits``)."""
MIXED_ROW_SPLITS = 2048
"""Rows x splits past which ``mixed_step_splits`` adds no split: a step of that many rows holds
many decode rows (prompt rows of 2,048+ tokens are few), and the partials' workspace (rows x
heads x splits x head_dim float32, kept in a captured graph's pool) stays bounded."""


def mixed_step_splits(num_rows: int, num_kv_heads: int, max_blocks_per_row: int, block_size: int,
                      device: torch.device) -> int:
    """Split count for the one-token rows of a step that also holds long prompt rows (its rows
    counted with the prompts' and the graph's padding): ``choose_num_splits`` of its rows, but at
    least enough that a full-length row's splits hold <= ``MIXED_SPLIT_KEYS`` keys. Such a step
    may have few decode rows among many: counted as rows they would get one split each, a few
    programs streaming a long row apiece; a row's splits past its keys cost an empty program.
    Past ``MIXED_ROW_SPLITS`` rows x splits no more."""
    width = max_blocks_per_row * block_size
    least = min(triton.cdiv(width, MIXED_SPLIT_KEYS), _MAX_SPLITS, max(1, MIXED_ROW_SPLITS // max(1, num_rows)))
    return max(choose_num_splits(num_rows, num_kv_heads, max_blocks_per_row, block_size, device), least)
