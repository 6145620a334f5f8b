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
                        topk_weights: torch.Tensor, gated: bool, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None,
                        scale_block_n: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """See ``kernels.moe_experts.fused_experts``. With scales: FP8 experts, each expert linear the
    emulated W8A8 block-scaled linear (``fp8_quant.fp8_linear_reference``; each output rounded to x's
    dtype, as the FP8 kernel rounds its rows)."""
    if w13_scale is None:
        def lin1(a, e):
            return F.linear(a, w13[e])

        def lin2(a, e):
            return F.linear(a, w2[e])
    else:
        from megatron_async.kernels.fp8_quant import fp8_linear_reference

        def lin1(a, e):
            return fp8_linear_reference(a, w13[e], w13_scale[e], scale_block_n=scale_block_n[0])

        def lin2(a, e):
            return fp8_linear_reference(a, w2[e], w2_scale[e], None, scale_block_n[1])
    num_experts = w13.shape[0]
    out = torch.zeros((x.shape[0], w2.shape[1]), dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        h = expert_activation(lin1(x[token], e), gated)
        y = lin2(h, e).float() * topk_weights[token, slot, None]
        out.index_add_(0, token, y)
    return out.to(x.dtype)
