"""Mamba2 op dispatcher and backend switch. The mixer's decode steps call the ``*_inplace`` ops
here; its mixed steps go through ``mamba_varlen_ops`` and its speculative windows through
``mamba_window_ops``, which read the backend set here. The four functional ops (padded rows,
gathered states) serve kernel comparisons and tests: the model no longer calls them, so the
``mamba_ssm`` packages are used nowhere in a forward (MAMBA_SSM runs this repo's kernels there).

Backends (``MambaBackend``): TORCH, the pure-torch reference (``conv1d_torch`` / ``ssd_torch``,
CPU and CUDA, the ground truth); TRITON, this repo's kernels (``triton_mamba_decode``,
``triton_ssd_prefill``; CUDA, or CPU under ``TRITON_INTERPRET=1`` for tests); MAMBA_SSM, the
optional ``mamba_ssm`` + ``causal_conv1d`` packages (CUDA, never required).

The four functional ops work on gathered per-row states and return the new states, so every
backend shares one state-pool protocol with the mixer. The two ``*_inplace`` decode ops
instead read and advance the rows' states directly in the slot pools (no gather / scatter
copies of the large SSM state): on TRITON and MAMBA_SSM they run the in-repo Triton kernels,
on TORCH the reference with an explicit gather and scatter. ``dt`` given to the functional ops
is the final step size (bias, softplus and limits applied by the mixer); the in-place decode
op can apply them itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_async.config import MambaBackend
from megatron_async.kernels import conv1d_torch, ssd_torch

_backend: MambaBackend = MambaBackend.TORCH


def _mamba_ssm_importable() -> bool:
    try:
        import causal_conv1d  # noqa: F401
        import mamba_ssm  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_usable(on_cuda: bool) -> bool:
    """Triton imports and its kernels can run here: compiled on CUDA, interpreted on CPU (only
    when TRITON_INTERPRET=1 was set before the kernels were decorated)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from megatron_async.kernels import triton_mamba_decode
    except ImportError:
        return False
    return on_cuda or isinstance(triton_mamba_decode._state_update_kernel, InterpretedFunction)


def set_mamba_backend(backend: MambaBackend | str, device: torch.device | str) -> MambaBackend:
    """Pick the process-wide Mamba backend. AUTO: on CUDA, MAMBA_SSM when its packages import,
    else TRITON when triton imports, else TORCH; on CPU, TORCH."""
    global _backend
    backend = MambaBackend(backend)
    on_cuda = torch.device(device).type == "cuda"
    if backend == MambaBackend.AUTO:
        backend = MambaBackend.TORCH
        if on_cuda and _mamba_ssm_importable():
            backend = MambaBackend.MAMBA_SSM
        elif on_cuda and _triton_usable(on_cuda):
            backend = MambaBackend.TRITON
    elif backend == MambaBackend.MAMBA_SSM and not (on_cuda and _mamba_ssm_importable()):
        raise ValueError("MambaBackend.MAMBA_SSM needs CUDA and the mamba_ssm + causal_conv1d packages")
    elif backend == MambaBackend.TRITON and not _triton_usable(on_cuda):
        raise ValueError("MambaBackend.TRITON needs triton on CUDA, or TRITON_INTERPRET=1 set before import on CPU")
    _backend = backend
    return backend


def get_mamba_backend() -> MambaBackend:
    return _backend


def conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows x [b, l, c] after states [b, c, K-1] -> (silu(conv) [b, l, c], final states)."""
    if _backend == MambaBackend.TRITON:
        from megatron_async.kernels.triton_ssd_prefill import causal_conv1d_prefill

        return causal_conv1d_prefill(x, weight, bias, initial_state, lengths)
    if _backend == MambaBackend.MAMBA_SSM:
        from causal_conv1d import causal_conv1d_fn

        # Prepend the state as K-1 extra inputs: the plain causal conv then sees each row's
        # true left context, and its first K-1 outputs (over the state) are dropped.
        k = weight.shape[1]
        ext = torch.cat([initial_state.to(x.dtype), x.transpose(1, 2)], dim=2).contiguous()
        out = causal_conv1d_fn(ext, weight, bias, activation="silu")[:, :, k - 1 :].transpose(1, 2)
        idx = lengths.long()[:, None] + torch.arange(k - 1, device=x.device)[None, :]
        final = ext.gather(2, idx[:, None, :].expand(-1, ext.shape[1], -1))
        return out, final.to(initial_state.dtype)
    return conv1d_torch.causal_conv1d(x, weight, bias, initial_state, lengths)


def conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x [b, c], state [b, c, K-1] -> (silu(conv) [b, c], new state)."""
    if _backend == MambaBackend.TRITON:
        from megatron_async.kernels.triton_mamba_decode import causal_conv1d_update

        new_state = torch.empty_like(state)
        return causal_conv1d_update(x, weight, bias, state, out_state=new_state), new_state
    if _backend == MambaBackend.MAMBA_SSM:
        from causal_conv1d import causal_conv1d_update

        state = state.contiguous()  # the kernel shifts this (gathered) copy in place
        out = causal_conv1d_update(x, state, weight, bias, activation="silu")
        return out, state
    return conv1d_torch.causal_conv1d_step(x, weight, bias, state)


def ssd_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked scan of right-padded rows (pads carry dt = 0) -> (y [b, l, h, p], final state fp32).

    ``chunk_size`` is the model's; the math does not depend on it, so the TRITON kernel uses
    its own tile size."""
    if _backend == MambaBackend.TRITON:
        from megatron_async.kernels.triton_ssd_prefill import ssd_scan

        return ssd_scan(x, dt, A, B, C, D, initial_state)
    if _backend == MambaBackend.MAMBA_SSM:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        y, final = mamba_chunk_scan_combined(
            x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state, return_final_states=True
        )
        return y.float(), final.float()
    return ssd_torch.ssd_chunked(x, dt, A, B, C, chunk_size, D=D, initial_state=initial_state)


def ssd_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x [b, h, p], dt [b, h], B / C [b, g, n] -> (y [b, h, p] fp32, new state fp32)."""
    if _backend == MambaBackend.TRITON:
        from megatron_async.kernels.triton_mamba_decode import selective_state_update

        state = state.float()
        new_state = torch.empty_like(state)
        return selective_state_update(x, dt, A, B, C, D, state, out_state=new_state), new_state
    if _backend == MambaBackend.MAMBA_SSM:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update

        h, p, n = state.shape[1:]
        state = state.float().contiguous()  # updated in place by the kernel
        y = selective_state_update(
            state,
            x.float(),
            dt.float()[:, :, None].expand(-1, h, p),
            A.float()[:, None, None].expand(h, p, n),
            B.float(),
            C.float(),
            D=D.float()[:, None].expand(h, p),
        )
        return y.float(), state
    return ssd_torch.ssd_step(x, dt, A, B, C, state, D)


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
) -> torch.Tensor:
    """One token per row: x [b, c] -> silu(conv) [b, c]. Row r's state is ``conv_pool[slots[r]]``
    ([S, c, K-1]; zeros when ``has_initial_state[r]`` is False) and is advanced there in place."""
    if _backend in (MambaBackend.TRITON, MambaBackend.MAMBA_SSM):
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
) -> torch.Tensor:
    """One token per row: x [b, h, p], dt [b, h], B / C [b, g, n] -> y [b, h, p] fp32. Row r's
    state is ``ssm_pool[slots[r]]`` ([S, h, p, n] fp32; zeros when ``has_initial_state[r]`` is
    False) and is advanced there in place. dt: ``dt_bias`` added, softplus, ``dt_limit`` clamp,
    each only when given."""
    if _backend in (MambaBackend.TRITON, MambaBackend.MAMBA_SSM):
        from megatron_async.kernels.triton_mamba_decode import selective_state_update

        return selective_state_update(
            x, dt, A, B, C, D, ssm_pool, slots=slots, has_initial_state=has_initial_state,
            dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
        )
    dt = final_step_size(dt, dt_bias, dt_softplus, dt_limit)
    y, new_state = ssd_torch.ssd_step(x, dt, A, B, C, gather_states(ssm_pool, slots, has_initial_state), D)
    ssm_pool.index_copy_(0, slots, new_state)
    return y
