"""Mamba2 decode ops on the state pools, and the step-size and state-gather helpers the other
Mamba ops share. The mixer's decode steps call the ``*_inplace`` ops here; its mixed steps go
through ``mamba_varlen_ops`` and its speculative windows through ``mamba_window_ops``.

Every op takes ``triton`` (the model's ``KernelBackends.triton_mamba``): True runs this repo's
kernels (``triton_mamba_decode``; CUDA, or CPU under ``TRITON_INTERPRET=1`` for tests), False
the pure-torch reference (``conv1d_torch`` / ``ssd_torch``, CPU and CUDA, the ground truth).
The decode ops read and advance the rows' states directly in the slot pools (no gather /
scatter copies of the large SSM state on the kernel path; the reference gathers and scatters).
The SSM ops (decode, varlen, window) can take dt raw and A as A_log and apply dt's bias,
softplus and limits and A = -exp(A_log) themselves: the kernels do it in-kernel with the same
math on every path (``triton_mamba_decode.step_size`` / ``decay_rate``), so no torch prep
kernels run per layer; the reference does it with ``final_step_size`` / ``decay_rates``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_async.kernels import conv1d_torch, ssd_torch


def final_step_size(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float] | None
) -> torch.Tensor:
    """The mixer's order on a raw dt, in float32: bias added, softplus, clamp (each when given)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit is not None:
        dt = dt.clamp(*dt_limit)
    return dt


def decay_rates(A: torch.Tensor, A_is_log: bool) -> torch.Tensor:
    """The per-head A in float32: as given, or -exp(A_log)."""
    return -torch.exp(A.float()) if A_is_log else A


def gather_states(pool: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
    """Rows' states from the pool; rows without an initial state start from zeros."""
    states = pool.index_select(0, slots)
    return torch.where(has_init.view(-1, *([1] * (states.dim() - 1))), states, torch.zeros_like(states))


def conv1d_decode_inplace(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    triton: bool = False,
) -> torch.Tensor:
    """One token per row: x [b, c] -> silu(conv) [b, c]. Row r's state is ``conv_pool[slots[r]]``
    ([S, c, K-1]; zeros when ``has_initial_state[r]`` is False) and is advanced there in place."""
    if triton:
        from megatron_async.kernels.triton_mamba_decode import causal_conv1d_update

        return causal_conv1d_update(x, weight, bias, conv_pool, slots=slots, has_initial_state=has_initial_state)
    out, new_state = conv1d_torch.causal_conv1d_step(x, weight, bias, gather_states(conv_pool, slots, has_initial_state))
    conv_pool.index_copy_(0, slots, new_state.to(conv_pool.dtype))
    return out


def ssd_decode_inplace(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    triton: bool = False,
    A_is_log: bool = False,
) -> torch.Tensor:
    """One token per row: x [b, h, p], dt [b, h], B / C [b, g, n] -> y [b, h, p] fp32. Row r's
    state is ``ssm_pool[slots[r]]`` ([S, h, p, n] fp32; zeros when ``has_initial_state[r]`` is
    False) and is advanced there in place. dt: ``dt_bias`` added, softplus, ``dt_limit`` clamp,
    each only when given; ``A_is_log``: A holds A_log (A = -exp(A_log))."""
    if triton:
        from megatron_async.kernels.triton_mamba_decode import selective_state_update

        return selective_state_update(
            x, dt, A, B, C, D, ssm_pool, slots=slots, has_initial_state=has_initial_state,
            dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, A_is_log=A_is_log,
        )
    dt, A = final_step_size(dt, dt_bias, dt_softplus, dt_limit), decay_rates(A, A_is_log)
    y, new_state = ssd_torch.ssd_step(x, dt, A, B, C, gather_states(ssm_pool, slots, has_initial_state), D)
    ssm_pool.index_copy_(0, slots, new_state)
    return y
