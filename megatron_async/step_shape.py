"""StepShape: the host-side sizes and flags of one assembled step."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepShape:
    """Host-side sizes and flags of one assembled step (no device reads needed)."""

    num_tokens: int
    num_rows: int
    max_query_len: int
    max_kv_len: int
    is_decode_only: bool
    any_sampling: bool  # some row is not greedy
    any_top_k_top_p: bool  # some sampled row filters (top-k, top-p or min-p)
    max_top_n: int
    any_log_probs: bool
    any_penalties: bool = False  # some sampling row has a sampling slot (penalties / min_tokens)
    filters: tuple[bool, bool, bool] = (False, False, False)  # some sampled row uses (top-k, top-p, min-p)
    num_samples: int = -1  # sampled positions (rows plus drafts); -1: one per row
    sample_base: list[int] | None = None  # host copy: each row's first sample (speculative decoding)
    num_drafts: list[int] | None = None  # host copy: drafts each row verifies (speculative decoding)
    verify_width: int = 0  # > 0: a uniform verify step, every row this many tokens and samples (padded)
    any_grammar: bool = False  # some sampling row has a grammar: its sampling waits for the host's token masks
    any_lora: bool = True  # some token has a LoRA adapter (LoRA engines); False: its forward may skip the adapters
    long_tiles: bool = False  # the prefill attention runs its long-row launch (a row of LONG_TILE_MIN_QUERY+ tokens)
    num_multi_rows: int = -1  # hybrid: rows of several tokens that verify no drafts (see mamba_row_order); -1: unknown (a graph's shape)

    def __post_init__(self):
        if self.num_samples < 0:
            self.num_samples = self.num_rows
