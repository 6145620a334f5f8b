"""How the rows of one packed step split between the Mamba mixers' two paths: rows of one
token take a vectorised recurrent step, rows of several tokens a chunked scan over a padded
batch. Built once per forward on the host and shared by every Mamba layer."""
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

    @classmethod
    def build(cls, meta: MambaMetadata) -> MambaStepPlan:
        R = meta.num_rows
        slots, has_init = meta.state_slots[:R], meta.has_initial_state[:R]
        device = slots.device
        if meta.is_decode_only:
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
        single = [r for r in range(R) if lengths[r] == 1]
        multi = [r for r in range(R) if lengths[r] > 1]
        max_len = max((lengths[r] for r in multi), default=0)
        gather, valid, tokens, flat = [], [], [], []
        for m, r in enumerate(multi):
            gather.append([cu[r] + min(t, lengths[r] - 1) for t in range(max_len)])
            valid.append([t < lengths[r] for t in range(max_len)])
            tokens.extend(range(cu[r], cu[r + 1]))
            flat.extend(range(m * max_len, m * max_len + lengths[r]))

        def dev(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        padded = None
        if multi:
            padded = PaddedRows(
                rows=dev(multi), lengths=dev([lengths[r] for r in multi]),
                gather=dev(gather), valid=dev(valid, torch.bool), tokens=dev(tokens), flat=dev(flat),
            )
        return cls(slots, has_init, dev(single), dev([cu[r] for r in single]), padded, False)
