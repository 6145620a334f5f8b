"""How the rows of one packed step split between the Mamba mixers' paths: rows of one token
take a vectorised recurrent step, rows of several tokens a chunked scan over a padded batch,
and speculative verification rows (the last sampled token plus drafts) a decode window that
leaves every per-token state in the window scratch instead of the slot. Built once per forward
on the host and shared by every Mamba layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_async.inference.contexts.metadata import MambaMetadata


@dataclass
class PaddedRows:
    """Rows of several tokens, laid out right-padded as [M, max_len]."""

    rows: torch.Tensor  # [M] int64 row index
    lengths: torch.Tensor  # [M] int64 tokens of each row
    gather: torch.Tensor  # [M, max_len] int64 packed token index (pads repeat the row's last token)
    valid: torch.Tensor  # [M, max_len] bool
    tokens: torch.Tensor  # [V] int64 packed index of every real token ...
    flat: torch.Tensor  # [V] int64 ... and its position in the flattened [M * max_len] layout


@dataclass
class MambaStepPlan:
    """How the rows of one step split between the two paths; built once per forward and shared
    by every Mamba layer."""

    slots: torch.Tensor  # [R] int64 state slot of each row
    has_initial_state: torch.Tensor  # [R] bool
    single_rows: torch.Tensor  # [S] int64 rows with exactly one token ...
    single_tokens: torch.Tensor  # [S] int64 ... and that token's packed index
    multi: PaddedRows | None
    identity_order: bool  # decode-only: row r is token r, results need no scatter
    window: PaddedRows | None = None
    """Verification rows, padded to the longest (pads repeat the last token; the states after
    them land in scratch positions nobody commits)."""
    window_only: int = 0
    """T > 0: every row is a verification window of exactly T tokens, so tokens reshape to
    [R, T] with no gather or scatter (no host data needed: the CUDA-graph shape)."""

    @classmethod
    def build(cls, meta: MambaMetadata) -> MambaStepPlan:
        R = meta.num_rows
        slots, has_init = meta.state_slots[:R], meta.has_initial_state[:R]
        device = slots.device
        if meta.window_tokens:
            empty = torch.empty(0, dtype=torch.long, device=device)
            return cls(slots, has_init, empty, empty, None, False, window_only=meta.window_tokens)
        if meta.is_decode_only and not any(meta.host_window_rows or ()):
            # No host sync: every row is one token and row order is token order.
            rows = torch.arange(R, device=device)
            return cls(slots, has_init, rows, rows, None, True)

        # Row lengths are needed on the host to lay multi-token rows out as a padded batch. The
        # engine's context passes its host copy; without one (a hand-built batch) we read the
        # device tensor: a HOST SYNC, once per step, only in steps with a multi-token row.
        cu = meta.host_cu_query_lens
        if cu is None:
            cu = meta.cu_query_lens[: R + 1].tolist()
        lengths = [cu[r + 1] - cu[r] for r in range(R)]
        is_window = meta.host_window_rows or [False] * R
        single = [r for r in range(R) if lengths[r] == 1 and not is_window[r]]
        multi = [r for r in range(R) if lengths[r] > 1 and not is_window[r]]
        window = [r for r in range(R) if is_window[r]]

        def dev(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(slots, has_init, dev(single), dev([cu[r] for r in single]), _padded(multi, cu, dev), False,
                   window=_padded(window, cu, dev))


def _padded(rows: list[int], cu: list[int], dev) -> PaddedRows | None:
    """Lay ``rows`` out right-padded to the longest of them (None when there are none)."""
    if not rows:
        return None
    lengths = [cu[r + 1] - cu[r] for r in rows]
    max_len = max(lengths)
    gather, valid, tokens, flat = [], [], [], []
    for m, (r, n) in enumerate(zip(rows, lengths)):
        gather.append([cu[r] + min(t, n - 1) for t in range(max_len)])
        valid.append([t < n for t in range(max_len)])
        tokens.extend(range(cu[r], cu[r + 1]))
        flat.extend(range(m * max_len, m * max_len + n))
    return PaddedRows(rows=dev(rows), lengths=dev(lengths), gather=dev(gather), valid=dev(valid, torch.bool),
                      tokens=dev(tokens), flat=dev(flat))
