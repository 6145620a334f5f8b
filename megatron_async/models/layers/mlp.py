"""SwiGLU feed-forward with gate and up projections fused into one matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_async.kernels import fused_ops


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.intermediate = intermediate
        kw = dict(dtype=dtype, device=device)
        # rows [0, I) hold gate_proj, rows [I, 2I) hold up_proj
        self.gate_up_weight = nn.Parameter(torch.empty(2 * intermediate, hidden, **kw), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(hidden, intermediate, **kw), requires_grad=False)
        self.gate_up_bias = nn.Parameter(torch.empty(2 * intermediate, **kw), requires_grad=False) if bias else None
        self.down_bias = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False) if bias else None

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """HF tensor name -> the slice of our parameter it fills."""
        i = self.intermediate
        targets = {
            f"{prefix}.gate_proj.weight": self.gate_up_weight.data[:i],
            f"{prefix}.up_proj.weight": self.gate_up_weight.data[i:],
            f"{prefix}.down_proj.weight": self.down_weight.data,
        }
        if self.gate_up_bias is not None:
            targets[f"{prefix}.gate_proj.bias"] = self.gate_up_bias.data[:i]
            targets[f"{prefix}.up_proj.bias"] = self.gate_up_bias.data[i:]
            targets[f"{prefix}.down_proj.bias"] = self.down_bias.data
        return targets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        if fused_ops.use_fused(gate_up) and gate_up.dim() == 2:
            act = fused_ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) * up
        return F.linear(act, self.down_weight, self.down_bias)
