"""What a model's forward reads besides its input ids: the step's attention and Mamba metadata
and caches. These types sit below ``models/`` and ``kernels/`` (which import nothing from
``inference/``); the engine's context above fills them.

Everything here is built by ``DynamicInferenceContext`` on the CPU and reaches the
device in the single H2D copy of ``ContextGPUView``; the tensors below are slices of
that view (fixed addresses), the ints are host-side sizes of the step.

Row = one request scheduled in the step (a prefill chunk or one decode token).
Tokens of a step are packed row after row: row r owns tokens
``cu_query_lens[r] : cu_query_lens[r + 1]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    """Tokens in the step (T)."""
    num_rows: int
    """Rows (requests) in the step (R)."""
    max_query_len: int
    """Longest row's query length in this step (1 for decode-only steps)."""
    max_kv_len: int
    """Longest row's KV length after this step's tokens are appended."""
    is_decode_only: bool
    """Every row has exactly one query token."""
    positions: torch.Tensor
    """[T] int64: absolute position of each token in its sequence."""
    slot_mapping: torch.Tensor
    """[T] int64: flat KV slot (block_id * block_size + offset) each token's K/V is written to."""
    token_to_row: torch.Tensor
    """[T] int32: row index of each token."""
    cu_query_lens: torch.Tensor
    """[R + 1] int32: prefix sums of query lengths."""
    kv_lens: torch.Tensor
    """[R] int32: KV length of each row after this step (cached prefix + new tokens)."""
    block_table: torch.Tensor
    """[R, max_blocks_per_request] int32: KV block ids of each row; unused entries are the dummy block 0."""
    block_size: int
    """Tokens per KV block."""
    row_order: torch.Tensor | None = None
    """[R] int32: a permutation of the rows, longest KV first (``longest_first``). The decode
    kernel starts the longest rows' programs first, so the short ones fill the tail (workload
    A's lengths: -3.5 % for the kernel alone, -1.4 % of a decode step's attention in the engine).
    None: row order."""
    long_tiles: bool = False
    """The prefill kernel runs its long-row launch (``triton_prefill_common.HOPPER_LONG``): the host chose
    it for a step whose longest row has ``LONG_TILE_MIN_QUERY``+ tokens (``StepShape.long_tiles``)."""
    scratch: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Values the kernels derive from this step's tensors, computed by the first layer that
    needs them and reused by the others (the prefill attention's tile schedule). A new
    metadata object per step, so nothing here outlives its step."""


def longest_first(kv_lens) -> np.ndarray:
    """Rows by descending KV length, ties in row order: the one rule of every snapshot path."""
    return np.argsort(-np.asarray(kv_lens, dtype=np.int64), kind="stable").astype(np.int32)


@dataclass
class MambaMetadata:
    """Hybrid models only: which state slot each row reads and writes."""

    state_slots: torch.Tensor
    """[R] int64: index into the live Mamba state pool of each row."""
    has_initial_state: torch.Tensor
    """[R] bool: the row continues a state (later prefill chunk, decode); False = start from zeros."""
    cu_query_lens: torch.Tensor
    """[R + 1] int32: same as AttentionMetadata.cu_query_lens (tokens of each row)."""
    num_rows: int
    is_decode_only: bool
    max_query_len: int
    """Longest row's tokens (a bound: a mixed CUDA graph's padded token count)."""
    token_to_row: torch.Tensor | None = None
    """[T] int32: same as AttentionMetadata.token_to_row."""
    row_order: torch.Tensor | None = None
    """[R] int64: the verification windows first (``num_window_rows``), then the other rows of
    several tokens, then those of one token (``DynamicInferenceContext``'s ``mamba_row_order``)."""
    num_scan_rows: int = 0
    """How many rows after the windows the reference backend runs through the chunked scan (the
    rest take the one-token step): the rows of several tokens, or every row in a graph's shape."""
    num_window_rows: int = 0
    """Speculative verification rows (last sampled token + drafts): they run as a decode window
    whose per-token states go to the window scratch; their slots change only when the accepted
    state is committed."""
    max_window_len: int = 0
    """Tokens of the longest verification window (drafts + 1)."""
    window_tokens: int = 0
    """T > 0: every row is a verification window of exactly T tokens (the mixers then reshape
    tokens to [R, T]: the shape CUDA graphs capture)."""

    @classmethod
    def for_rows(cls, lengths: list[int], slots: list[int], has_init: list[bool], device: torch.device | str,
                 window_rows: list[bool] | None = None, window_tokens: int = 0) -> MambaMetadata:
        """Metadata of a hand-built batch (tests, benchmarks): rows of ``lengths`` tokens packed
        in order (``window_rows``: verification windows); the engine's context fills the same
        fields from its step snapshot."""
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        order, num_multi = mamba_row_order(cu, window_rows)
        windows = [n for n, w in zip(lengths, window_rows or [False] * len(lengths)) if w]
        return cls(
            state_slots=torch.tensor(slots, device=device), has_initial_state=torch.tensor(has_init, device=device),
            cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=device), num_rows=len(lengths),
            is_decode_only=all(n == 1 for n in lengths) and not windows, max_query_len=max(lengths),
            token_to_row=torch.tensor([r for r, n in enumerate(lengths) for _ in range(n)], dtype=torch.int32, device=device),
            row_order=torch.tensor(order, device=device), num_scan_rows=num_multi, num_window_rows=len(windows),
            max_window_len=max(windows, default=0), window_tokens=window_tokens,
        )


@dataclass
class ForwardBatch:
    """What a model's forward needs besides input ids."""

    attn: AttentionMetadata
    kv_caches: list[torch.Tensor]
    """One tensor per attention layer: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    mamba: MambaMetadata | None = None
    conv_states: list[torch.Tensor] = field(default_factory=list)
    """Hybrid: one per Mamba layer, [num_slots, conv_dim, d_conv - 1]."""
    ssm_states: list[torch.Tensor] = field(default_factory=list)
    """Hybrid: one per Mamba layer, [num_slots, num_heads, head_dim, d_state]."""
    conv_window_states: list[torch.Tensor] = field(default_factory=list)
    """Hybrid with speculation: one per Mamba layer, [num_slots, k + 1, conv_dim, d_conv - 1],
    the conv state after each token of a slot's verification window."""
    ssm_window_states: list[torch.Tensor] = field(default_factory=list)
    """Hybrid with speculation: one per Mamba layer, [num_slots, k + 1, num_heads, head_dim,
    d_state], the SSM state after each token of a slot's verification window."""
    ep_num_tokens: int | None = None
    """Expert parallelism: the token count every EP rank pads its MoE-layer input to in this
    step (agreed by the engines on the CPU; >= this rank's token count, equal on all ranks of
    the EP group). None: no expert parallelism."""
    batch_invariant: bool = False
    """Run the batch-invariant kernels (``InferenceConfig.batch_invariant``)."""
    routed_experts: torch.Tensor | None = None
    """Routing replay: [>= T, num_moe_layers, top_k] int16 at a fixed address; MoE layer l writes
    token t's top-k global expert ids to ``[t, l]``. None: nothing is recorded."""
    lora_slots: torch.Tensor | None = None
    """LoRA (``InferenceConfig.enable_lora``): [T] int32, each token's adapter slot (-1: the base
    model), read by the adapted linears (``parallel/lora_slots.py``). None: no adapters."""
    lora_groups: LoRAGroups | None = None
    """LoRA: ``lora_slots`` grouped by slot once per forward (``kernels/lora_groups.py``), which every
    adapted linear of the step reads instead of the slots alone. None: the ungrouped LoRA op."""

    @property
    def lora_rows(self) -> LoRAGroups | torch.Tensor | None:
        """What the adapted linears take: the step's grouping where built, else the slots."""
        return self.lora_groups if self.lora_groups is not None else self.lora_slots


@dataclass(frozen=True)
class LoRAGroups:
    """A step's tokens grouped by LoRA adapter slot (built on the device from ``slots``, once per
    forward, by ``kernels.lora_groups.group_lora_rows``), so a LoRA tile holds rows of one slot."""
    slots: torch.Tensor
    """[T] int32, each token's slot (-1: the base model): ``ForwardBatch.lora_slots``."""
    order: torch.Tensor
    """[T] int32, the token indices sorted by slot (stable); the tokens of slot -1 last."""
    slot_starts: torch.Tensor
    """[L + 2] int32: slot l's tokens are ``order[slot_starts[l]:slot_starts[l + 1]]`` (l = L: the
    tokens of slot -1); the last entry is T."""
    tiles: torch.Tensor
    """[max_tiles, 3] int32 rows (slot, first position in ``order``, rows <= block_m), one per tile of
    ``block_m`` rows of one slot, slot after slot; the table's length is fixed by T, L and block_m
    (a CUDA graph's launch grid), its unused rows are (-1, 0, 0)."""
    block_m: int
    """Rows per tile (the LoRA op's ``LoRATiles.block_m`` for T rows)."""


def mamba_row_order(cu: list[int], is_window: list[bool] | None) -> tuple[list[int], int]:
    """The snapshot's ``mamba_row_order`` of a step with row prefix sums ``cu``: verification
    windows first, then the other rows of several tokens, then those of one token. Returns
    (order, how many of the second kind)."""
    R = len(cu) - 1
    win = is_window or [False] * R
    multi = [r for r in range(R) if cu[r + 1] - cu[r] > 1 and not win[r]]
    single = [r for r in range(R) if cu[r + 1] - cu[r] <= 1 and not win[r]]
    return [r for r in range(R) if win[r]] + multi + single, len(multi)
