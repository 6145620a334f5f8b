"""Mamba2 mixer over a packed step: decode-only steps take a vectorised recurrent step; mixed
steps run every row through the packed (varlen) conv + chunked scan, reading the rows' layout
from the step snapshot on the device; speculative verification rows run as decode windows (see
mamba_step_plan.py). Each row reads its conv / SSM state from its slot (zeros when it has no
initial state) and its final state is written back to the slot in place."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_async.kernels import mamba_ops, mamba_varlen_ops, mamba_window_ops
from megatron_async.kernels.mamba_varlen_ops import PaddedRows, VarlenRows
from megatron_async.models.hybrid_config import MambaConfig
from megatron_async.models.quantization import NO_QUANT, QuantScope
from megatron_async.models.layers.block import StepInputs
from megatron_async.models.layers.mamba_step_plan import MambaStepPlan
from megatron_async.parallel.linear import MergedColumnParallelLinear, RowParallelLinear
from megatron_async.parallel.sharding import Sharding, sharded_param
from megatron_async.parallel.state import ParallelState


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, norm_before_gate: bool
) -> torch.Tensor:
    """RMSNorm over groups of ``group_size`` channels, gated by silu(z); float32 inside."""
    y, gate = y.float(), F.silu(z.float())
    if not norm_before_gate:
        y = y * gate
    groups = y.view(*y.shape[:-1], -1, group_size)
    y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).view_as(y)
    y = y * weight.float()
    if norm_before_gate:
        y = y * gate
    return y


class GatedGroupRMSNorm(nn.Module):
    """Mamba2's gated RMSNorm over this rank's groups (each of ``group_size`` channels)."""

    def __init__(self, cfg: MambaConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.cfg = cfg
        sharding = Sharding.split(0, cfg.intermediate_size, parallel, "Mamba n_groups * group size")
        self.weight = sharded_param((cfg.intermediate_size // parallel.tp_size,), sharding, dtype, device)

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype, triton: bool = False) -> torch.Tensor:
        """y [T, I] float32, z [T, I] -> [T, I] in ``out_dtype``; ``triton``: one fused kernel."""
        c = self.cfg
        if triton:
            from megatron_async.kernels import triton_mamba_norm

            return triton_mamba_norm.gated_rms_norm(y, z, self.weight, c.norm_group_size, c.norm_eps,
                                                    c.norm_before_gate, out_dtype)
        return gated_rms_norm(y, z, self.weight, c.norm_group_size, c.norm_eps, c.norm_before_gate).to(out_dtype)


class MambaConv1d(nn.Module):
    """Depthwise causal conv weights over this rank's x / B / C channels (HF nn.Conv1d layout)."""

    def __init__(self, cfg: MambaConfig, parallel: ParallelState, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        parts = (cfg.intermediate_size, cfg.n_groups * cfg.d_state, cfg.n_groups * cfg.d_state)
        sharding = Sharding.split(0, parts, parallel, "Mamba conv channels")
        local = sum(parts) // parallel.tp_size
        self.weight = sharded_param((local, 1, cfg.conv_kernel), sharding, dtype, device)
        self.bias = sharded_param((local,), sharding, dtype, device) if cfg.use_conv_bias else None


class Mamba2Mixer(nn.Module):
    """Tensor parallel as Megatron's MambaMixer: this rank owns ``num_heads / tp`` heads and
    ``n_groups / tp`` groups. in_proj is column-parallel with its z / x / B / C / dt parts each
    split (by heads or by groups), the conv and SSM states hold only local channels and heads,
    A / D / dt_bias are per local head, the gated norm runs over local groups, and out_proj is
    row-parallel. A local head's group is still ``head // (heads per group)``."""

    def __init__(self, hidden_size: int, cfg: MambaConfig, state_index: int, parallel: ParallelState,
                 dtype: torch.dtype, device: torch.device | str, quant: QuantScope = NO_QUANT):
        """``state_index``: this layer's conv / SSM state pools among the model's Mamba layers;
        ``quant``: whether in_proj / out_proj are FP8 (conv, A, D, dt and the norm never are)."""
        super().__init__()
        self.cfg, self.state_index = cfg, state_index
        self.num_heads = parallel.tp_divide(cfg.num_heads, "Mamba num_heads")
        self.n_groups = parallel.tp_divide(cfg.n_groups, "Mamba n_groups")
        self.intermediate = self.num_heads * cfg.head_dim
        self.group_dim = self.n_groups * cfg.d_state
        self.conv_dim = self.intermediate + 2 * self.group_dim
        I, GN, H = cfg.intermediate_size, cfg.n_groups * cfg.d_state, cfg.num_heads
        self.in_proj = MergedColumnParallelLinear(hidden_size, [I, I, GN, GN, H], cfg.proj_bias, parallel, dtype,
                                                  device, "Mamba in_proj parts", shard_ids=("z", "x", "B", "C", "dt"),
                                                  fp8=quant.fp8("in_proj"))
        self.conv1d = MambaConv1d(cfg, parallel, dtype, device)
        per_head = Sharding.split(0, H, parallel, "Mamba num_heads")
        self.dt_bias = sharded_param((self.num_heads,), per_head, dtype, device)
        self.A_log = sharded_param((self.num_heads,), per_head, dtype, device)
        self.D = sharded_param((self.num_heads,), per_head, dtype, device)
        self.norm = GatedGroupRMSNorm(cfg, parallel, dtype, device)
        self.out_proj = RowParallelLinear(I, hidden_size, cfg.proj_bias, parallel, dtype, device, "Mamba heads * head_dim",
                                          quant.fp8("out_proj"))

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's (conv state, SSM state) shape per slot."""
        return (self.conv_dim, self.cfg.conv_kernel - 1), (self.num_heads, self.cfg.head_dim, self.cfg.d_state)

    def _split_xbc(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., conv_dim] -> x [..., H, P], B [..., G, N], C [..., G, N]."""
        xs, B, C = t.split([self.intermediate, self.group_dim, self.group_dim], dim=-1)
        groups = (self.n_groups, self.cfg.d_state)
        return xs.unflatten(-1, (self.num_heads, self.cfg.head_dim)), B.unflatten(-1, groups), C.unflatten(-1, groups)

    def _step_rows(
        self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor,
        conv_pool: torch.Tensor, ssm_pool: torch.Tensor, triton: bool,
    ) -> torch.Tensor:
        """One token per row: xbc [S, conv_dim], dt [S, H] -> y [S, H, P] float32. The rows'
        states are advanced in place in their slots (distinct per real row)."""
        conv_out = mamba_ops.conv1d_decode_inplace(
            xbc, self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_pool, slots, has_init, triton=triton
        )
        xs, B, C = self._split_xbc(conv_out)
        return mamba_ops.ssd_decode_inplace(xs, dt, self.A_log, B, C, self.D, ssm_pool, slots, has_init,
                                            triton=triton, **self._step_prep())

    def _varlen_rows(self, xbc: torch.Tensor, dt: torch.Tensor, rows: VarlenRows, conv_pool: torch.Tensor,
                     ssm_pool: torch.Tensor) -> torch.Tensor:
        """Every row of a mixed step, packed: xbc [T, conv_dim], dt [T, H] -> y [T, H, P] float32."""
        conv_out = mamba_varlen_ops.conv1d_varlen_inplace(xbc, self.conv1d.weight[:, 0, :], self.conv1d.bias,
                                                          conv_pool, rows)
        xs, B, C = self._split_xbc(conv_out)
        return mamba_varlen_ops.ssd_varlen_inplace(xs, dt, self.A_log, B, C, self.D, ssm_pool, rows,
                                                   self.cfg.chunk_size, **self._step_prep())

    def _window_rows(
        self, xbc: torch.Tensor, dt: torch.Tensor, w: PaddedRows | None, T: int, slots: torch.Tensor,
        has_init: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
        conv_scratch: torch.Tensor, ssm_scratch: torch.Tensor, triton: bool,
    ) -> torch.Tensor:
        """Verification windows: rows laid out [W, T] (``w``'s padded gather, or a plain reshape
        when ``w`` is None: every token is a window token) -> y [W * T, H, P] float32."""
        xbc_w = xbc.view(-1, T, self.conv_dim) if w is None else xbc[w.gather]
        dt_w = dt.view(-1, T, self.num_heads) if w is None else dt[w.gather]
        conv_out = mamba_window_ops.conv1d_window(
            xbc_w, self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_pool, conv_scratch, slots, has_init,
            triton=triton,
        )
        xs, B, C = self._split_xbc(conv_out)
        y = mamba_window_ops.ssd_window(xs, dt_w, self.A_log, B, C, self.D, ssm_pool, ssm_scratch, slots,
                                        has_init, triton=triton, **self._step_prep())
        return y.flatten(0, 1)

    def _step_prep(self) -> dict:
        """The SSM ops take dt raw and A as A_log, in their stored dtypes, and make the step size
        (bias, softplus, limits) and A = -exp(A_log) themselves: in-kernel on the Triton paths,
        the same bits on decode, mixed and window steps, no torch prep kernels."""
        return dict(dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.cfg.dt_limit, A_is_log=True)

    def forward(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; advances the rows' states in this layer's pools in place."""
        batch, i = step.batch, self.state_index
        windows = (batch.conv_window_states[i], batch.ssm_window_states[i]) if batch.conv_window_states else None
        return self.mix(x, batch.conv_states[i], batch.ssm_states[i], step.mamba_plan, windows, step.kernels.split_k)

    def mix(
        self, x: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor, plan: MambaStepPlan,
        window_scratch: tuple[torch.Tensor, torch.Tensor] | None = None, split_k: bool = True,
    ) -> torch.Tensor:
        """``window_scratch``: this layer's (conv, SSM) window scratch, needed when the plan has
        verification rows. ``split_k``: the model's ``KernelBackends.split_k`` (for the out projection)."""
        T, H, I = x.shape[0], self.num_heads, self.intermediate
        z, xbc, dt = self.in_proj(x).split([I, self.conv_dim, H], dim=-1)
        pools = (conv_pool, ssm_pool)
        if (plan.window_only or plan.window is not None) and window_scratch is None:
            raise ValueError("a step with speculative verification rows needs the Mamba window scratch")
        if plan.window_only:
            y = self._window_rows(xbc, dt, None, plan.window_only, plan.slots, plan.has_initial_state, *pools,
                                  *window_scratch, plan.triton)
        elif plan.identity_order:
            y = self._step_rows(xbc, dt, plan.slots, plan.has_initial_state, *pools, plan.triton)
        else:
            y = self._varlen_rows(xbc, dt, plan.varlen, *pools)
            w = plan.window
            if w is not None:  # verification windows beside other rows (eager speculative steps)
                T_w = w.gather.shape[1]
                y_w = self._window_rows(xbc, dt, w, T_w, plan.slots[w.rows], plan.has_initial_state[w.rows], *pools,
                                        *window_scratch, plan.triton)
                y_ext = torch.cat([y, y.new_empty(1, *y.shape[1:])])  # y_ext[T] takes the pads
                w.scatter(y_ext, y_w.unflatten(0, (-1, T_w)))
                y = y_ext[:T]
        return self.out_proj(self.norm(y.view(T, I), z, x.dtype, plan.triton), False, split_k)
