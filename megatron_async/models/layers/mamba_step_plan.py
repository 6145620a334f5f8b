"""How the rows of one packed step reach the Mamba mixers' paths, built once per forward from
the step snapshot's device views and host sizes (no host read, no copy of host data) and shared
by every Mamba layer:
- decode-only steps: every row one token, row r is token r (the vectorised recurrent step);
- mixed steps (prefill chunks beside decode tokens): ``VarlenRows``, the packed conv + chunked
  scan over ``cu_query_lens`` / ``token_to_row`` / ``state_slots`` / ``has_initial_state`` /
  ``mamba_row_order``; shapes from the (padded) token and row counts only, so a CUDA graph
  captures it like any other step;
- speculative verify rows (the last sampled token + drafts) run as decode windows that leave
  every per-token state in the window scratch: uniform windows reshape to [R, T]; windows beside
  other rows are laid out [W, longest window] on the device from ``mamba_row_order`` (windows
  first) while the packed path skips them (slot -1)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_async.forward_batch import MambaMetadata
from megatron_async.kernels.mamba_varlen_ops import PaddedRows, VarlenRows, padded_rows, varlen_rows


@dataclass
class MambaStepPlan:
    slots: torch.Tensor  # [R] int64 state slot of each row
    has_initial_state: torch.Tensor  # [R] bool
    identity_order: bool = False  # decode-only: row r is token r, results need no scatter
    varlen: VarlenRows | None = None
    """Mixed steps: the rows that run through the packed conv + scan (device tables)."""
    window: PaddedRows | None = None
    """Verification windows beside other rows, padded to the longest (pads repeat the last token;
    the states after them land in scratch positions nobody commits)."""
    window_only: int = 0
    """T > 0: every row is a verification window of exactly T tokens, so tokens reshape to
    [R, T] with no gather or scatter."""
    triton: bool = False
    """The mixers run the Triton kernels (the model's ``KernelBackends.triton_mamba``), else the
    torch reference."""

    @classmethod
    def build(cls, meta: MambaMetadata, triton: bool = False) -> MambaStepPlan:
        R, W = meta.num_rows, meta.num_window_rows
        slots, has_init = meta.state_slots[:R], meta.has_initial_state[:R]
        if meta.window_tokens:
            return cls(slots, has_init, window_only=meta.window_tokens, triton=triton)
        if meta.is_decode_only and not W:
            return cls(slots, has_init, identity_order=True, triton=triton)
        order, cu = meta.row_order[:R], meta.cu_query_lens[: R + 1]
        rows = varlen_rows(slots, has_init, cu, meta.token_to_row, order[W:], meta.num_scan_rows, meta.max_query_len,
                           skip_rows=order[:W] if W else None, triton=triton)
        window = padded_rows(order[:W], cu, meta.token_to_row.shape[0], meta.max_window_len) if W else None
        return cls(slots, has_init, varlen=rows, window=window, triton=triton)
