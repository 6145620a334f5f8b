"""SwiGLU feed-forward with gate and up projections fused into one matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_async.kernels import fused_ops
from megatron_async.models.weight_loading import Target
from megatron_async.parallel.layers import column_parallel_linear, divide, row_parallel_linear, shard_target
from megatron_async.parallel.state import tp_size


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        # Tensor parallelism: gate_up is column-parallel, down row-parallel; this rank's share.
        intermediate = divide(intermediate, tp_size(), "intermediate_size")
        self.intermediate = intermediate
        kw = dict(dtype=dtype, device=device)
        # rows [0, I) hold gate_proj, rows [I, 2I) hold up_proj
        self.gate_up_weight = nn.Parameter(torch.empty(2 * intermediate, hidden, **kw), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(hidden, intermediate, **kw), requires_grad=False)
        self.gate_up_bias = nn.Parameter(torch.empty(2 * intermediate, **kw), requires_grad=False) if bias else None
        self.down_bias = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False) if bias else None

    def hf_targets(self, prefix: str) -> dict[str, Target]:
        """HF tensor name -> the slice of our parameter it fills (and, under TP, the rank's
        share of the HF tensor: gate and up are each cut separately)."""
        i = self.intermediate
        full = i * tp_size()
        targets = {
            f"{prefix}.gate_proj.weight": shard_target(self.gate_up_weight.data[:i], 0, full),
            f"{prefix}.up_proj.weight": shard_target(self.gate_up_weight.data[i:], 0, full),
            f"{prefix}.down_proj.weight": shard_target(self.down_weight.data, 1, full),
        }
        if self.gate_up_bias is not None:
            targets[f"{prefix}.gate_proj.bias"] = shard_target(self.gate_up_bias.data[:i], 0, full)
            targets[f"{prefix}.up_proj.bias"] = shard_target(self.gate_up_bias.data[i:], 0, full)
            targets[f"{prefix}.down_proj.bias"] = self.down_bias.data
        return targets

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        gate_up = column_parallel_linear(x, self.gate_up_weight, self.gate_up_bias, batch_invariant)
        if (batch_invariant or fused_ops.use_fused(gate_up)) and gate_up.dim() == 2:
            act = fused_ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) * up
        return row_parallel_linear(act, self.down_weight, self.down_bias, batch_invariant)
