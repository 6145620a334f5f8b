"""Pure-torch reference of the routed experts: a loop over experts with index_add (as
transformers computes it). Its per-expert token lists have data-dependent sizes (host syncs),
so it is the numerical reference and the CPU path, not a CUDA-graph path."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_activation(h: torch.Tensor, gated: bool) -> torch.Tensor:
    """SwiGLU over [gate | up] halves, or relu(h)^2."""
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return torch.relu(h).square()


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, gated: bool) -> torch.Tensor:
    """See ``kernels.moe_experts.fused_experts``."""
    num_experts = w13.shape[0]
    out = torch.zeros((x.shape[0], w2.shape[1]), dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        h = expert_activation(F.linear(x[token], w13[e]), gated)
        y = F.linear(h, w2[e]).float() * topk_weights[token, slot, None]
        out.index_add_(0, token, y)
    return out.to(x.dtype)
