"""Padding of a step snapshot: the rows, tokens and samples a padded CUDA-graph replay, a graph
capture and the startup warm-up run on beside (or instead of) real ones.

Padding is harmless by construction: padding tokens sit at position 0 and write their K/V only
to the dummy block; padding rows see one key of it and use the padding slots (Mamba state,
sampling state, speculative state); padding samples are greedy and count nothing. Works on the
numpy views of one host buffer (``BookkeepingLayout.views``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_async.inference.contexts.kv_block_allocator import DUMMY_BLOCK


@dataclass(frozen=True)
class PaddingSlots:
    """Where padding writes: the padding slot of each per-request state."""

    block_size: int
    mamba_slot: int
    """Padding Mamba state slot (0 without Mamba layers: nothing reads it)."""
    sampling_slot: int
    spec_slot: int | None
    """Padding speculative slot; None: the snapshot has no speculative fields."""


def fill_padding(v: dict, pad: PaddingSlots, a: int, b: int, ta: int, tb: int) -> None:
    """Rows [a, b) own tokens [ta, tb): one each in order, the last row the remainder (rows past
    the tokens get none); one sample per row, at the row's index (no drafts)."""
    cu = np.minimum(np.arange(ta + 1, ta + b - a + 1), tb)
    cu[-1] = tb
    v["cu_query_lens"][a + 1 : b + 1] = cu
    starts = np.concatenate(([ta], cu[:-1]))
    v["token_to_row"][ta:tb] = np.repeat(np.arange(a, b), cu - starts)
    _tokens(v, pad, ta, tb)
    _samples(v, pad, a, b, np.maximum(cu - 1, 0), np.arange(a, b))
    _rows(v, pad, a, b, np.arange(a, b))


def fill_verify_padding(v: dict, pad: PaddingSlots, a: int, b: int, width: int) -> None:
    """Padding rows [a, b) of a uniform verify step: row r owns tokens and samples
    [r * width, (r + 1) * width) (every token sampled)."""
    ta, tb = a * width, b * width
    rows = np.repeat(np.arange(a, b), width)
    v["cu_query_lens"][a + 1 : b + 1] = np.arange(a + 1, b + 1) * width
    v["token_to_row"][ta:tb] = rows
    _tokens(v, pad, ta, tb)
    _samples(v, pad, ta, tb, np.arange(ta, tb), rows)
    _rows(v, pad, a, b, np.arange(a, b) * width)


def fill_penalty_padding(v: dict, a: int, b: int, padding_slot: int) -> None:
    """Samples [a, b): no sampling slot, penalties off."""
    v["sampling_slot"][a:b] = padding_slot
    v["min_p"][a:b] = 0.0
    v["presence_penalty"][a:b] = 0.0
    v["frequency_penalty"][a:b] = 0.0
    v["repetition_penalty"][a:b] = 1.0
    v["suppress_stop"][a:b] = False


def _tokens(v: dict, pad: PaddingSlots, ta: int, tb: int) -> None:
    v["input_ids"][ta:tb] = 0
    v["prev_sample_idx"][ta:tb] = -1
    v["positions"][ta:tb] = 0
    v["slot_mapping"][ta:tb] = DUMMY_BLOCK * pad.block_size
    if pad.spec_slot is not None:
        v["spec_src"][ta:tb] = -1
    if "lora_slot" in v:  # padding tokens: no adapter
        v["lora_slot"][ta:tb] = -1


def _samples(v: dict, pad: PaddingSlots, sa: int, sb: int, token_idx: np.ndarray, rows: np.ndarray) -> None:
    v["sample_token_idx"][sa:sb] = token_idx
    v["sample_position"][sa:sb] = 0
    v["seed"][sa:sb] = 0
    v["temperature"][sa:sb] = 0.0
    v["top_k"][sa:sb] = 1
    v["top_p"][sa:sb] = 0.0
    fill_penalty_padding(v, sa, sb, pad.sampling_slot)
    if pad.spec_slot is not None:
        v["sample_to_row"][sa:sb] = rows


def _rows(v: dict, pad: PaddingSlots, a: int, b: int, sample_base: np.ndarray) -> None:
    v["kv_lens"][a:b] = 1
    v["attention_row_order"][a:b] = np.arange(a, b)  # after the real rows' permutation: still a permutation
    v["state_slots"][a:b] = pad.mamba_slot
    v["has_initial_state"][a:b] = False
    if "mamba_row_order" in v:  # hybrid: padding rows keep their own order
        v["mamba_row_order"][a:b] = np.arange(a, b)
    v["block_table"][a:b] = DUMMY_BLOCK
    if pad.spec_slot is not None:
        v["spec_slot"][a:b] = pad.spec_slot
        v["spec_owner_slot"][a:b] = pad.spec_slot
        v["spec_inflight"][a:b] = False
        v["num_drafts"][a:b] = 0
        v["sample_base"][a:b] = sample_base
