"""Mamba2 mixer over a packed step: rows of one token (decode, or a one-token prefill chunk)
take a vectorised recurrent step; rows of several tokens run the chunked scan on a padded
batch. Each row reads its conv / SSM state from its slot (zeros when it has no initial
state) and its final state is written back to the slot in place."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_async.inference.contexts.metadata import MambaMetadata
from megatron_async.kernels import mamba_ops
from megatron_async.models.hybrid_config import MambaConfig


@dataclass
class _PaddedRows:
    """Rows of several tokens, laid out right-padded as [M, max_len]."""

    rows: torch.Tensor  # [M] int64 row index
    lengths: torch.Tensor  # [M] int64 tokens of each row
    gather: torch.Tensor  # [M, max_len] int64 packed token index (pads repeat the row's last token)
    valid: torch.Tensor  # [M, max_len] bool
    tokens: torch.Tensor  # [V] int64 packed index of every real token ...
    flat: torch.Tensor  # [V] int64 ... and its position in the flattened [M * max_len] layout


@dataclass
class MambaStepPlan:
    """How the rows of one step split between the two paths; built once per forward and shared
    by every Mamba layer."""

    slots: torch.Tensor  # [R] int64 state slot of each row
    has_initial_state: torch.Tensor  # [R] bool
    single_rows: torch.Tensor  # [S] int64 rows with exactly one token ...
    single_tokens: torch.Tensor  # [S] int64 ... and that token's packed index
    multi: _PaddedRows | None
    identity_order: bool  # decode-only: row r is token r, results need no scatter

    @classmethod
    def build(cls, meta: MambaMetadata) -> MambaStepPlan:
        R = meta.num_rows
        slots, has_init = meta.state_slots[:R], meta.has_initial_state[:R]
        device = slots.device
        if meta.is_decode_only:
            # No host sync: every row is one token and row order is token order.
            rows = torch.arange(R, device=device)
            return cls(slots, has_init, rows, rows, None, True)

        # Row lengths are needed on the host to lay multi-token rows out as a padded batch. The
        # engine's context passes its host copy; without one (a hand-built batch) we read the
        # device tensor: a HOST SYNC, once per step, only in steps with a multi-token row.
        cu = meta.host_cu_query_lens
        if cu is None:
            cu = meta.cu_query_lens[: R + 1].tolist()
        lengths = [cu[r + 1] - cu[r] for r in range(R)]
        single = [r for r in range(R) if lengths[r] == 1]
        multi = [r for r in range(R) if lengths[r] > 1]
        max_len = max((lengths[r] for r in multi), default=0)
        gather, valid, tokens, flat = [], [], [], []
        for m, r in enumerate(multi):
            gather.append([cu[r] + min(t, lengths[r] - 1) for t in range(max_len)])
            valid.append([t < lengths[r] for t in range(max_len)])
            tokens.extend(range(cu[r], cu[r + 1]))
            flat.extend(range(m * max_len, m * max_len + lengths[r]))

        def dev(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        padded = None
        if multi:
            padded = _PaddedRows(
                rows=dev(multi), lengths=dev([lengths[r] for r in multi]),
                gather=dev(gather), valid=dev(valid, torch.bool), tokens=dev(tokens), flat=dev(flat),
            )
        return cls(slots, has_init, dev(single), dev([cu[r] for r in single]), padded, False)


def _read_states(pool: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
    """Gather rows' states from the pool; rows without an initial state start from zeros."""
    states = pool.index_select(0, slots)
    return torch.where(has_init.view(-1, *([1] * (states.dim() - 1))), states, torch.zeros_like(states))


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


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, cfg: MambaConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.cfg = cfg
        kw = dict(dtype=dtype, device=device)
        H, I = cfg.num_heads, cfg.intermediate_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)

        self.in_proj_weight = param(cfg.in_proj_size, hidden_size)
        self.in_proj_bias = param(cfg.in_proj_size) if cfg.proj_bias else None
        self.conv_weight = param(cfg.conv_dim, 1, cfg.conv_kernel)  # HF nn.Conv1d layout
        self.conv_bias = param(cfg.conv_dim) if cfg.use_conv_bias else None
        self.dt_bias = param(H)
        self.A_log = param(H)
        self.D = param(H)
        self.norm_weight = param(I)
        self.out_proj_weight = param(hidden_size, I)
        self.out_proj_bias = param(hidden_size) if cfg.proj_bias else None

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """HF tensor name -> our parameter it fills."""
        names = {
            "in_proj.weight": self.in_proj_weight, "in_proj.bias": self.in_proj_bias,
            "conv1d.weight": self.conv_weight, "conv1d.bias": self.conv_bias,
            "dt_bias": self.dt_bias, "A_log": self.A_log, "D": self.D, "norm.weight": self.norm_weight,
            "out_proj.weight": self.out_proj_weight, "out_proj.bias": self.out_proj_bias,
        }
        return {f"{prefix}.{k}": v.data for k, v in names.items() if v is not None}

    def _split_xbc(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., conv_dim] -> x [..., H, P], B [..., G, N], C [..., G, N]."""
        c = self.cfg
        xs, B, C = t.split([c.intermediate_size, c.n_groups * c.d_state, c.n_groups * c.d_state], dim=-1)
        groups = (c.n_groups, c.d_state)
        return xs.unflatten(-1, (c.num_heads, c.head_dim)), B.unflatten(-1, groups), C.unflatten(-1, groups)

    def _step_rows(
        self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor,
        conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        """One token per row: xbc [S, conv_dim], dt [S, H] -> y [S, H, P] float32. The rows'
        states are advanced in place in their slots (distinct per real row)."""
        conv_out = mamba_ops.conv1d_decode_inplace(
            xbc, self.conv_weight[:, 0, :], self.conv_bias, conv_pool, slots, has_init
        )
        xs, B, C = self._split_xbc(conv_out)
        return mamba_ops.ssd_decode_inplace(xs, dt, self._A(), B, C, self.D.float(), ssm_pool, slots, has_init)

    def _scan_rows(
        self, xbc: torch.Tensor, dt: torch.Tensor, m: _PaddedRows, slots: torch.Tensor, has_init: torch.Tensor,
        conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        """Rows of several tokens, padded: xbc [T, conv_dim], dt [T, H] -> y [M * max_len, H, P] float32."""
        valid = m.valid[..., None]
        zero = torch.zeros((), dtype=xbc.dtype, device=xbc.device)
        conv_out, conv_state = mamba_ops.conv1d_prefill(
            torch.where(valid, xbc[m.gather], zero), self.conv_weight[:, 0, :], self.conv_bias,
            _read_states(conv_pool, slots, has_init), m.lengths,
        )
        conv_pool.index_copy_(0, slots, conv_state.to(conv_pool.dtype))
        xs, B, C = self._split_xbc(conv_out)
        dt_pad = torch.where(valid, dt[m.gather], torch.zeros((), device=dt.device))  # pads: dt = 0, identity steps
        y, ssm_state = mamba_ops.ssd_prefill(
            xs, dt_pad, self._A(), B, C, self.cfg.chunk_size, self.D.float(), _read_states(ssm_pool, slots, has_init)
        )
        ssm_pool.index_copy_(0, slots, ssm_state)
        return y.flatten(0, 1)

    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def forward(
        self, x: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor, plan: MambaStepPlan
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; advances the rows' states in the pools in place."""
        cfg = self.cfg
        T, H, I = x.shape[0], cfg.num_heads, cfg.intermediate_size
        z, xbc, dt = F.linear(x, self.in_proj_weight, self.in_proj_bias).split([I, cfg.conv_dim, H], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*cfg.dt_limit)
        pools = (conv_pool, ssm_pool)
        if plan.identity_order:
            y = self._step_rows(xbc, dt, plan.slots, plan.has_initial_state, *pools)
        else:
            y = torch.empty(T, H, cfg.head_dim, dtype=torch.float32, device=x.device)
            rows, toks = plan.single_rows, plan.single_tokens
            if rows.numel() > 0:
                y[toks] = self._step_rows(xbc[toks], dt[toks], plan.slots[rows], plan.has_initial_state[rows], *pools)
            m = plan.multi
            if m is not None:
                y_m = self._scan_rows(xbc, dt, m, plan.slots[m.rows], plan.has_initial_state[m.rows], *pools)
                y[m.tokens] = y_m[m.flat]
        out = gated_rms_norm(y.view(T, I), z, self.norm_weight, cfg.norm_group_size, cfg.norm_eps, cfg.norm_before_gate)
        return F.linear(out.to(x.dtype), self.out_proj_weight, self.out_proj_bias)
