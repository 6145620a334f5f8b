"""Pure-torch reference of Mamba's depthwise causal conv1d with a carried state.

The conv state of a row is its last ``K - 1`` inputs ([C, K - 1], oldest first), so that
running a sequence in pieces, each starting from the previous piece's final state, equals
running it whole. Activation (SiLU) is applied to the output, as every Mamba2 mixer does.
Shapes: x [b, l, c] (tokens major, as packed activations are), weight [c, K], state [b, c, K - 1].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv of right-padded rows x [b, l, c] after their initial states [b, c, K - 1].

    ``lengths`` [b] (device tensor) gives the real tokens of each row (None: all l); the final
    state is taken after each row's last real token. Returns (silu(out) [b, l, c] in x's
    dtype, final_state [b, c, K - 1] in the state's dtype)."""
    b, l, c = x.shape
    k = weight.shape[1]
    ext = torch.cat([initial_state.to(x.dtype), x.transpose(1, 2)], dim=2)  # [b, c, K - 1 + l]
    out = F.conv1d(ext.to(weight.dtype), weight[:, None, :], bias, groups=c)  # [b, c, l]
    out = F.silu(out).transpose(1, 2).to(x.dtype)
    # In ext, row r's inputs up to its end are ext[:, :, : K - 1 + len_r]; keep the last K - 1.
    if lengths is None:
        final = ext[:, :, l:]
    else:
        idx = lengths.long()[:, None] + torch.arange(k - 1, device=x.device)[None, :]  # [b, K - 1]
        final = ext.gather(2, idx[:, None, :].expand(b, c, k - 1))
    return out, final.to(initial_state.dtype)


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x [b, c], state [b, c, K - 1] -> (silu(out) [b, c], new_state)."""
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [b, c, K]
    out = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out).to(x.dtype), window[:, :, 1:].to(state.dtype)
