"""MLP mixers: SwiGLU with gate and up fused into one column-parallel matmul (Llama, Qwen,
Bamba), and NemotronH's non-gated down(relu(up(x))^2); down is row-parallel in both."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_async.kernels import fused_ops, linear_op
from megatron_async.models.layers.block import StepInputs
from megatron_async.models.model_config import MLPConfig
from megatron_async.models.quantization import NO_QUANT, QuantScope
from megatron_async.parallel.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from megatron_async.parallel.state import ParallelState


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device | str, quant: QuantScope = NO_QUANT):
        super().__init__()
        # this rank's rows: [gate_local | up_local] (HF gate_proj = shard 0, up_proj = shard 1)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias, parallel, dtype, device,
                                                       "intermediate_size", fp8=quant.fp8("gate_proj", "up_proj"))
        self.intermediate = self.gate_up_proj.output_sizes[0]
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, parallel, dtype, device, "intermediate_size",
                                           quant.fp8("down_proj"))

    @property
    def fp8_input_linear(self) -> MergedColumnParallelLinear | None:
        """The FP8 linear that alone reads this mixer's input (its norm may hand it quantized rows)."""
        return self.gate_up_proj if self.gate_up_proj.weight_scale_inv is not None else None

    def forward(self, x: torch.Tensor, step: StepInputs | None = None) -> torch.Tensor:
        """x: [T, hidden], or its rows quantized for the FP8 gate_up (``fp8_input_linear``)."""
        inv = step is not None and step.batch.batch_invariant
        fused = step is None or step.kernels.fused
        split_k = step is None or step.kernels.split_k
        lora = step.batch.lora_rows if step is not None else None  # adapters: gate_up's output, then the SiLU
        plain = self.gate_up_proj.weight_scale_inv is None and (lora is None or self.gate_up_proj.lora is None)
        if plain and not inv and fused_ops.use_fused(x, fused) and x.dim() == 2:
            act = fused_ops.swiglu_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
            if act is not None:
                return self.down_proj(act, inv, split_k, lora)
        if inv and x.dim() == 2 and plain:
            act = linear_op.invariant_swiglu(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
            if act is not None:
                return self.down_proj(act, inv, split_k, lora)
        gate_up = self.gate_up_proj(x, inv, lora)
        if (inv or fused_ops.use_fused(gate_up, fused)) and gate_up.dim() == 2:
            if not inv and fused_ops.fp8_input_prequantized(gate_up.shape[0], gate_up.dtype, gate_up.device,
                                                            self.down_proj):
                return self.down_proj(fused_ops.silu_and_mul_quantized(gate_up), inv, split_k)  # SwiGLU + FP8 quantize
            act = fused_ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act, inv, split_k, lora)


class ReluSquaredMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device | str, quant: QuantScope = NO_QUANT):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias, parallel, dtype, device, "intermediate_size",
                                            quant.fp8("up_proj"))
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, parallel, dtype, device, "intermediate_size",
                                           quant.fp8("down_proj"))

    @property
    def fp8_input_linear(self) -> ColumnParallelLinear | None:
        """The FP8 linear that alone reads this mixer's input (its norm may hand it quantized rows)."""
        return self.up_proj if self.up_proj.weight_scale_inv is not None else None

    def forward(self, x: torch.Tensor, step: StepInputs | None = None) -> torch.Tensor:
        """x: [T, hidden], or its rows quantized for the FP8 up projection (``fp8_input_linear``).
        The up projection and relu(h)^2 in one kernel where it pays off (``triton_swiglu_matmul``);
        else relu(h)^2 in one kernel (torch's bits), quantized in it too for an FP8 down that would
        quantize its input in a pass of its own."""
        inv = step is not None and step.batch.batch_invariant
        fused = step is None or step.kernels.fused
        split_k = step is None or step.kernels.split_k
        lora = step.batch.lora_rows if step is not None else None
        plain = self.up_proj.weight_scale_inv is None and (lora is None or self.up_proj.lora is None)
        if (plain and not inv and fused_ops.use_fused(x, fused) and x.dim() == 2
                and not fused_ops.fp8_input_prequantized(x.shape[0], x.dtype, x.device, self.down_proj)):
            act = fused_ops.swiglu_linear(x, self.up_proj.weight, self.up_proj.bias, gated=False)  # up + relu^2
            if act is not None:
                return self.down_proj(act, inv, split_k, lora)
        h = self.up_proj(x, inv, lora)
        if fused_ops.use_fused(h, fused) and h.dim() == 2:
            if not inv and fused_ops.fp8_input_prequantized(h.shape[0], h.dtype, h.device, self.down_proj):
                return self.down_proj(fused_ops.relu_square_quantized(h), inv, split_k)
            return self.down_proj(fused_ops.relu_square(h), inv, split_k, lora)
        return self.down_proj(torch.relu(h).square(), inv, split_k, lora)


def build_mlp(hidden: int, cfg: MLPConfig, parallel: ParallelState, dtype: torch.dtype,
              device: torch.device | str, quant: QuantScope = NO_QUANT) -> nn.Module:
    cls = SwiGLUMLP if cfg.gated else ReluSquaredMLP
    return cls(hidden, cfg.intermediate_size, cfg.bias, parallel, dtype, device, quant)
