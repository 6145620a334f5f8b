"""Mamba2 op dispatcher: the mixer calls these four functions and nothing else.

Backends: the pure-torch reference (``conv1d_torch`` / ``ssd_torch``, CPU and CUDA), or, on
CUDA, the ``causal_conv1d`` and ``mamba_ssm`` packages when they are importable (never
required). All four ops are functional on gathered per-row states: the mixer gathers the
rows' states from the slot pools, and writes the returned states back, so every backend
shares one state-pool protocol. ``dt`` is always the final step size (bias, softplus and
limits applied by the mixer), so the backends never see the dt options.
"""
from __future__ import annotations

import torch

from megatron_async.config import MambaBackend
from megatron_async.kernels import conv1d_torch, ssd_torch

_backend: MambaBackend = MambaBackend.TORCH


def _fast_kernels_importable() -> bool:
    try:
        import causal_conv1d  # noqa: F401
        import mamba_ssm  # noqa: F401
    except ImportError:
        return False
    return True


def set_mamba_backend(backend: MambaBackend | str, device: torch.device | str) -> MambaBackend:
    """Pick the process-wide Mamba backend. TRITON means the ``mamba_ssm`` (Triton) and
    ``causal_conv1d`` (CUDA) kernels; AUTO picks them on CUDA when importable, else TORCH."""
    global _backend
    backend = MambaBackend(backend)
    on_cuda = torch.device(device).type == "cuda"
    if backend == MambaBackend.AUTO:
        backend = MambaBackend.TRITON if on_cuda and _fast_kernels_importable() else MambaBackend.TORCH
    elif backend == MambaBackend.TRITON and not (on_cuda and _fast_kernels_importable()):
        raise ValueError("MambaBackend.TRITON needs CUDA and the mamba_ssm + causal_conv1d packages")
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
    """Chunked scan of right-padded rows (pads carry dt = 0) -> (y [b, l, h, p], final state fp32)."""
    if _backend == MambaBackend.TRITON:
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
