"""Mamba2 decode windows for speculative verification, and committing the accepted state.

A window row runs T tokens (its last sampled token, then its drafts) from its committed slot
state without writing that slot: the conv / SSM state after every token t goes to the
per-slot scratch ``scratch[slot, t]``. Once the accepted counts are known on the device,
``commit_window_states`` copies ``scratch[slot, accepted]`` into each row's slot; a rejected
tail costs nothing to undo, since the slot was never touched.

``triton`` as in ``mamba_ops``: False runs the reference (T sequential single-token steps,
obviously equal to T decode steps), True this repo's window kernels.
"""
from __future__ import annotations

import torch

from megatron_async.kernels import conv1d_torch, ssd_torch
from megatron_async.kernels.mamba_ops import decay_rates, final_step_size, gather_states


def conv1d_window(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    conv_scratch: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    triton: bool = False,
) -> torch.Tensor:
    """x [b, T, c] -> silu(conv) [b, T, c]. Row r starts from ``conv_pool[slots[r]]`` ([S, c,
    K-1]; zeros without an initial state) and leaves the state after token t in
    ``conv_scratch[slots[r], t]`` ([S, >= T, c, K-1]); the pool is only read."""
    if triton:
        from megatron_async.kernels.triton_mamba_window import causal_conv1d_window

        return causal_conv1d_window(x, weight, bias, conv_pool, conv_scratch, slots, has_initial_state)
    state = gather_states(conv_pool, slots, has_initial_state)
    outs = []
    for t in range(x.shape[1]):
        out, state = conv1d_torch.causal_conv1d_step(x[:, t], weight, bias, state)
        conv_scratch[slots, t] = state.to(conv_scratch.dtype)
        outs.append(out)
    return torch.stack(outs, dim=1)


def ssd_window(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_pool: torch.Tensor,
    ssm_scratch: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    triton: bool = False,
    A_is_log: bool = False,
) -> torch.Tensor:
    """x [b, T, h, p], dt [b, T, h], B / C [b, T, g, n] -> y [b, T, h, p] fp32. Row r starts from
    ``ssm_pool[slots[r]]`` and leaves the state after token t in ``ssm_scratch[slots[r], t]``
    ([S, >= T, h, p, n] fp32); the pool is only read. dt and ``A_is_log`` as in
    ``mamba_ops.ssd_decode_inplace``."""
    if triton:
        from megatron_async.kernels.triton_mamba_window import selective_state_window

        return selective_state_window(
            x, dt, A, B, C, D, ssm_pool, ssm_scratch, slots, has_initial_state,
            dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, A_is_log=A_is_log,
        )
    dt, A = final_step_size(dt, dt_bias, dt_softplus, dt_limit), decay_rates(A, A_is_log)
    state = gather_states(ssm_pool, slots, has_initial_state)
    ys = []
    for t in range(x.shape[1]):
        y, state = ssd_torch.ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state, D)
        ssm_scratch[slots, t] = state
        ys.append(y)
    return torch.stack(ys, dim=1)


def commit_window_states(
    pools: list[torch.Tensor], scratches: list[torch.Tensor], slots: torch.Tensor, accepted: torch.Tensor,
    rows: torch.Tensor | None = None, triton: bool = False,
) -> None:
    """For every row r (where ``rows[r]``, when given) and every (pool, scratch) pair:
    ``pool[slots[r]] = scratch[slots[r], accepted[r]]``. ``accepted`` [R] is a device tensor
    (drafts accepted, 0..T-1: the state after the last sampled token plus that many drafts);
    nothing reads it on the host, and only the rows' slots are written, never the whole pool."""
    if triton:
        from megatron_async.kernels.triton_mamba_window import commit_window_state

        for pool, scratch in zip(pools, scratches, strict=True):
            commit_window_state(pool, scratch, slots, accepted, rows)
        return
    for pool, scratch in zip(pools, scratches, strict=True):
        new = scratch[slots, accepted.long()]
        if rows is not None:  # rows left out write their own state back
            new = torch.where(rows.view(-1, *([1] * (new.dim() - 1))), new, pool[slots])
        pool.index_copy_(0, slots, new)
