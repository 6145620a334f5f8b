"""Pure-torch reference of the Mamba2 state-space scan (SSD): the ground truth for fast backends.

Shapes (b = batch, l = time, h = heads, p = head_dim, g = groups, n = d_state):
x [b, l, h, p], dt [b, l, h], A [h], B / C [b, l, g, n], state [b, h, p, n].
``dt`` is the final step size (dt bias, softplus and limits already applied), so a time step
with ``dt == 0`` leaves the state unchanged: callers pad ragged rows with dt = 0 and the final
state of a padded row is exactly the state after its last real token.

Recurrence, per head: state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t B_t^T,
y_t = state_t C_t + D * x_t. Head h reads group h // (h_total / g).
Everything is computed in float32; outputs are float32.
"""
from __future__ import annotations

import torch


def _heads_from_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., g, n] -> [..., h, n]: each group serves num_heads / g consecutive heads."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan starting from ``initial_state`` (zeros when None).

    Returns (y [b, l, h, p], final_state [b, h, p, n]), both float32."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    q = chunk_size
    nc = (l + q - 1) // q
    pad = nc * q - l
    x, dt, A = x.float(), dt.float(), A.float()
    Bh, Ch = _heads_from_groups(B.float(), h), _heads_from_groups(C.float(), h)
    if pad:  # dt = 0 padding: identity steps that add nothing to the state
        x, dt = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)), torch.nn.functional.pad(dt, (0, 0, 0, pad))
        Bh, Ch = torch.nn.functional.pad(Bh, (0, 0, 0, 0, 0, pad)), torch.nn.functional.pad(Ch, (0, 0, 0, 0, 0, pad))
    xc = x.view(b, nc, q, h, p)
    Bc, Cc = Bh.view(b, nc, q, h, n), Ch.view(b, nc, q, h, n)
    dtc = dt.view(b, nc, q, h)
    xdt = xc * dtc[..., None]  # input scaled by its step size
    cum = torch.cumsum(dtc * A, dim=2)  # [b, c, q, h] log-decay from the chunk start (<= 0)

    # Within a chunk: y_i += sum_{j <= i} exp(cum_i - cum_j) (C_i . B_j) dt_j x_j.
    seg = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [b, c, i, j, h]
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal[None, None, :, :, None], float("-inf")))
    scores = torch.einsum("bcihn,bcjhn->bcijh", Cc, Bc) * decay
    y = torch.einsum("bcijh,bcjhp->bcihp", scores, xdt)

    # What each chunk adds to the state by its end, starting from zero.
    to_end = torch.exp(cum[:, :, -1:, :] - cum)  # [b, c, q, h]
    chunk_states = torch.einsum("bcjhn,bcjh,bcjhp->bchpn", Bc, to_end, xdt)

    # Across chunks: carry the state (a short sequential loop over chunks, no host sync).
    state = x.new_zeros(b, h, p, n) if initial_state is None else initial_state.float()
    chunk_decay = torch.exp(cum[:, :, -1, :])  # [b, c, h]
    starts = []
    for c in range(nc):
        starts.append(state)
        state = state * chunk_decay[:, c, :, None, None] + chunk_states[:, c]
    start = torch.stack(starts, dim=1)  # [b, c, h, p, n] state entering each chunk

    # The entering state, decayed to each position and read out through C.
    y = y + torch.einsum("bcihn,bchpn,bcih->bcihp", Cc, start, torch.exp(cum))
    y = y.reshape(b, nc * q, h, p)[:, :l]
    if D is not None:
        y = y + x[:, :l] * D.float()[:, None]
    return y, state


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    D: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step for a batch of rows: x [b, h, p], dt [b, h], B / C [b, g, n],
    state [b, h, p, n] -> (y [b, h, p], new_state [b, h, p, n]), float32."""
    h = x.shape[1]
    x, dt = x.float(), dt.float()
    Bh, Ch = _heads_from_groups(B.float(), h), _heads_from_groups(C.float(), h)
    decay = torch.exp(dt * A.float())[:, :, None, None]
    new_state = state.float() * decay + (x * dt[..., None])[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    if D is not None:
        y = y + x * D.float()[:, None]
    return y, new_state


def ssd_sequential(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence (slow, obviously right): same contract as ``ssd_chunked``."""
    b, l, h, p = x.shape
    state = x.new_zeros(b, h, p, B.shape[-1], dtype=torch.float32) if initial_state is None else initial_state.float()
    ys = []
    for t in range(l):
        y, state = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state, D)
        ys.append(y)
    return torch.stack(ys, dim=1), state
