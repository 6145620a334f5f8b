"""How the rows of one packed step reach the Mamba mixers' paths, built once per forward and
shared by every Mamba layer:
- decode-only steps: every row one token, row r is token r (the vectorised recurrent step);
- mixed steps (prefill chunks beside decode tokens): ``VarlenRows``, every table a view of the
  step snapshot (``cu_query_lens``, ``token_to_row``, ``state_slots``, ``has_initial_state``,
  ``mamba_row_order``): no host read, no copy of host data, shapes from the (padded) token and
  row counts only, so a CUDA graph captures it like any other step;
- speculative verify steps (rows verifying drafts run as decode windows that leave every
  per-token state in the window scratch): uniform windows reshape to [R, T] with no table;
  windows beside other rows take a layout built here on the host from the context's host copy
  of the row lengths (those steps always run eager, see graph_plan.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_async.inference.contexts.metadata import MambaMetadata
from megatron_async.kernels.mamba_varlen_ops import PaddedRows, VarlenRows, varlen_rows


@dataclass
class MambaStepPlan:
    slots: torch.Tensor  # [R] int64 state slot of each row
    has_initial_state: torch.Tensor  # [R] bool
    single_rows: torch.Tensor  # [S] int64 rows with exactly one token (decode-only and window steps) ...
    single_tokens: torch.Tensor  # [S] int64 ... and that token's packed index
    multi: PaddedRows | None  # window steps: rows of several tokens that are no window
    identity_order: bool  # decode-only: row r is token r, results need no scatter
    window: PaddedRows | None = None
    """Verification rows, padded to the longest (pads repeat the last token; the states after
    them land in scratch positions nobody commits)."""
    window_only: int = 0
    """T > 0: every row is a verification window of exactly T tokens, so tokens reshape to
    [R, T] with no gather or scatter (no host data needed: the CUDA-graph shape)."""
    varlen: VarlenRows | None = None
    """Mixed steps without windows: every row through the packed conv + scan (device tables)."""

    @classmethod
    def build(cls, meta: MambaMetadata) -> MambaStepPlan:
        R = meta.num_rows
        slots, has_init = meta.state_slots[:R], meta.has_initial_state[:R]
        device = slots.device
        empty = torch.empty(0, dtype=torch.long, device=device)
        if meta.window_tokens:
            return cls(slots, has_init, empty, empty, None, False, window_only=meta.window_tokens)
        windows = any(meta.host_window_rows or ())
        if meta.is_decode_only and not windows:
            rows = torch.arange(R, device=device)
            return cls(slots, has_init, rows, rows, None, True)
        if not windows:
            rows = varlen_rows(slots, has_init, meta.cu_query_lens[: R + 1], meta.token_to_row, meta.row_order[:R],
                               meta.num_scan_rows, meta.max_query_len)
            return cls(slots, has_init, empty, empty, None, False, varlen=rows)
        return cls._with_windows(meta, slots, has_init)

    @classmethod
    def _with_windows(cls, meta: MambaMetadata, slots: torch.Tensor, has_init: torch.Tensor) -> MambaStepPlan:
        """Windows beside other rows: laid out from the host copy of the row lengths (these
        tables are copied to the device here: speculative verify steps are eager anyway)."""
        R, cu = meta.num_rows, meta.host_cu_query_lens
        if cu is None:  # a hand-built batch: a HOST SYNC
            cu = meta.cu_query_lens[: R + 1].tolist()
        lengths = [cu[r + 1] - cu[r] for r in range(R)]
        is_window = meta.host_window_rows
        single = [r for r in range(R) if lengths[r] == 1 and not is_window[r]]
        multi = [r for r in range(R) if lengths[r] > 1 and not is_window[r]]
        window = [r for r in range(R) if is_window[r]]

        def dev(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(slots.device, non_blocking=True)

        return cls(slots, has_init, dev(single), dev([cu[r] for r in single]), _host_padded(multi, cu, dev), False,
                   window=_host_padded(window, cu, dev))


def _host_padded(rows: list[int], cu: list[int], dev) -> PaddedRows | None:
    """Lay ``rows`` out right-padded to the longest of them (None when there are none)."""
    if not rows:
        return None
    T = cu[-1]
    lengths = [cu[r + 1] - cu[r] for r in rows]
    max_len = max(lengths)
    gather = [[cu[r] + min(t, n - 1) for t in range(max_len)] for r, n in zip(rows, lengths)]
    valid = [[t < n for t in range(max_len)] for n in lengths]
    dest = [[g if ok else T for g, ok in zip(gs, vs)] for gs, vs in zip(gather, valid)]
    return PaddedRows(rows=dev(rows), lengths=dev(lengths), gather=dev(gather), valid=dev(valid, torch.bool),
                      dest=dev(dest))
