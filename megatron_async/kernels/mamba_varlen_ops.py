"""Mamba2 conv + SSD over the rows of a mixed step (prefill chunks and decode tokens packed
row after row), each row starting from its slot's state and leaving its final state there.

Every table comes from the step snapshot on the device (``VarlenRows``); nothing is read on the
host and no host data is copied, so the same code runs inside a CUDA graph. ``VarlenRows.triton``
(the model's ``KernelBackends.triton_mamba``) picks the path:
- True: the packed-layout kernels of ``triton_mamba_varlen`` (conv) and ``triton_ssd_varlen``
  (scan), grids from the padded token / row counts only;
- False (the reference): ``scan_rows`` run the chunked reference over a [M, max_len] layout built
  on the device from ``cu_query_lens``, the remaining rows (one token each) the recurrent step.
  M and max_len are host ints of the step (a graph's: every row, its padded token count).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_async.kernels import conv1d_torch, mamba_ops, ssd_torch


@dataclass
class PaddedRows:
    """Rows of several tokens laid out right-padded as [M, max_len] (device tensors)."""

    rows: torch.Tensor  # [M] int64 row index
    lengths: torch.Tensor  # [M] int64 tokens of each row
    gather: torch.Tensor  # [M, max_len] int64 packed token index (pads repeat a token of the row)
    valid: torch.Tensor  # [M, max_len] bool
    dest: torch.Tensor  # [M, max_len] int64 packed index of a real token, T (a spare entry) for pads

    def scatter(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """out [T + 1, ...] <- values [M, max_len, ...] at the real tokens (pads land in out[T])."""
        out.index_copy_(0, self.dest.flatten(), values.flatten(0, 1).to(out.dtype))


def padded_rows(rows: torch.Tensor, cu_query_lens: torch.Tensor, num_tokens: int, max_len: int) -> PaddedRows:
    """The [M, max_len] layout of ``rows`` from the device prefix sums (no host read)."""
    starts = cu_query_lens[rows].long()
    lengths = cu_query_lens[rows + 1].long() - starts
    j = torch.arange(max_len, device=rows.device)
    gather = (starts[:, None] + torch.minimum(j[None, :], (lengths - 1).clamp(min=0)[:, None])).clamp(0, max(num_tokens - 1, 0))
    valid = j[None, :] < lengths[:, None]
    return PaddedRows(rows, lengths, gather, valid, torch.where(valid, gather, num_tokens))


@dataclass
class VarlenRows:
    """The rows of a mixed step, all on the device (views of the step snapshot)."""

    slots: torch.Tensor  # [R] int64 state slot of each row (-1: skipped)
    has_initial_state: torch.Tensor  # [R] bool
    cu_query_lens: torch.Tensor  # [R + 1] int32
    token_to_row: torch.Tensor  # [T] int32
    triton: bool = False  # the kernels (else the torch reference)
    scan: PaddedRows | None = None  # torch reference: rows of several tokens
    single_rows: torch.Tensor | None = None  # torch reference: [S] int64 the other rows ...
    single_tokens: torch.Tensor | None = None  # ... and their token


def varlen_rows(slots: torch.Tensor, has_init: torch.Tensor, cu: torch.Tensor, token_to_row: torch.Tensor,
                row_order: torch.Tensor, num_scan_rows: int, max_len: int,
                skip_rows: torch.Tensor | None = None, triton: bool = False) -> VarlenRows:
    """``row_order``: the rows to run, those of several tokens first; the first ``num_scan_rows``
    of it take the scan on the torch reference (``triton``: the kernels run every row of the
    step). ``skip_rows``: rows left out (their slot reads -1: no state read or kept; their
    outputs are garbage for the caller to overwrite)."""
    if skip_rows is not None:
        slots = slots.index_fill(0, skip_rows, -1)
    rows = VarlenRows(slots, has_init, cu, token_to_row, triton)
    if not triton:
        T = token_to_row.shape[0]
        rows.scan = padded_rows(row_order[:num_scan_rows], cu, T, max_len) if num_scan_rows else None
        rows.single_rows = row_order[num_scan_rows:]
        rows.single_tokens = cu[rows.single_rows].long()
    return rows


def conv1d_varlen_inplace(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
                          rows: VarlenRows) -> torch.Tensor:
    """x [T, c] packed -> silu(conv) [T, c]; each row's state advanced in ``conv_pool`` in place."""
    if rows.triton:
        from megatron_async.kernels.triton_mamba_varlen import causal_conv1d_varlen

        return causal_conv1d_varlen(x, weight, bias, conv_pool, rows.slots, rows.has_initial_state,
                                    rows.cu_query_lens)
    T = x.shape[0]
    out = torch.empty(T + 1, *x.shape[1:], dtype=x.dtype, device=x.device)
    m, single = rows.scan, rows.single_rows
    states = []  # every row reads its old state before any row's new state is written
    if m is not None:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        init = _gather(conv_pool, rows, m.rows)
        y, final = conv1d_torch.causal_conv1d(torch.where(m.valid[..., None], x[m.gather], zero), weight, bias, init, m.lengths)
        m.scatter(out, y)
        states.append((m.rows, final))
    if single.numel():
        y, new = conv1d_torch.causal_conv1d_step(x[rows.single_tokens], weight, bias, _gather(conv_pool, rows, single))
        out.index_copy_(0, rows.single_tokens, y)
        states.append((single, new))
    for r, s in states:
        conv_pool.index_copy_(0, rows.slots[r], s.to(conv_pool.dtype))
    return out[:T]


def ssd_varlen_inplace(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor | None, ssm_pool: torch.Tensor, rows: VarlenRows, chunk_size: int,
                       dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                       dt_limit: tuple[float, float] | None = None, A_is_log: bool = False) -> torch.Tensor:
    """x [T, h, p], dt [T, h], B / C [T, g, n] -> y [T, h, p] float32; each row's state advanced
    in ``ssm_pool`` in place. dt and ``A_is_log`` as in ``mamba_ops.ssd_decode_inplace``.
    ``chunk_size``: the TORCH reference's chunk."""
    if rows.triton:
        from megatron_async.kernels.triton_ssd_varlen import ssd_scan_varlen

        return ssd_scan_varlen(x, dt, A, B, C, D, ssm_pool, rows.slots, rows.has_initial_state, rows.cu_query_lens,
                               dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, A_is_log=A_is_log)
    dt, A = mamba_ops.final_step_size(dt, dt_bias, dt_softplus, dt_limit), mamba_ops.decay_rates(A, A_is_log)
    T = x.shape[0]
    out = torch.empty(T + 1, *x.shape[1:], dtype=torch.float32, device=x.device)
    m, single = rows.scan, rows.single_rows
    states = []
    if m is not None:
        dt_pad = torch.where(m.valid[..., None], dt[m.gather], torch.zeros((), dtype=dt.dtype, device=dt.device))
        y, final = ssd_torch.ssd_chunked(x[m.gather], dt_pad, A, B[m.gather], C[m.gather], chunk_size, D=D,
                                         initial_state=_gather(ssm_pool, rows, m.rows))
        m.scatter(out, y)
        states.append((m.rows, final))
    if single.numel():
        t = rows.single_tokens
        y, new = ssd_torch.ssd_step(x[t], dt[t], A, B[t], C[t], _gather(ssm_pool, rows, single), D)
        out.index_copy_(0, t, y)
        states.append((single, new))
    for r, s in states:
        ssm_pool.index_copy_(0, rows.slots[r], s)
    return out[:T]


def _gather(pool: torch.Tensor, rows: VarlenRows, which: torch.Tensor) -> torch.Tensor:
    return mamba_ops.gather_states(pool, rows.slots[which], rows.has_initial_state[which])
