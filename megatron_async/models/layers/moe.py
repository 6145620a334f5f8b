"""Mixture-of-experts mixer: a replicated router picks k experts per token; the routed experts
are split over the expert-parallel group (and TP-split inside each expert); NemotronH adds an
always-on shared expert and optional latent projections around the routed experts.

Expert parallelism with data-parallel attention: every EP rank brings its OWN tokens, padded
to the count the engines agreed for this step (``StepInputs.ep_num_tokens``). The layer routes
its tokens locally, all-gathers tokens and routing over the EP group, runs its local experts on
all of them (ids of other ranks' experts mean "skip") and reduce-scatters the partial sums
back, so each rank receives the full MoE output of its own tokens. Padding rows are routed to
no expert. With TP inside, the expert outputs are then summed over the TP group. The optional
all-to-all exchange (``ParallelState.ep_exchange``) sends each token only to the ranks of its
experts, at the cost of a host sync per layer.

Where nothing stands between the routed experts and the next block's norm (TP and EP size 1,
no latent projections, no shared expert), a block's MoE mixer returns the grouped-GEMM
experts' last sum undone (``moe_grouped_mm.PendingCombine``): the norm sums the slots, adds
the residual and normalises in one kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_async.kernels import fused_ops
from megatron_async.kernels.backends import KernelBackends
from megatron_async.kernels.deferred_sum import DeferredSum
from megatron_async.kernels.moe_experts import fused_experts
from megatron_async.kernels.moe_lora import fused_experts_lora
from megatron_async.models.layers.block import StepInputs
from megatron_async.models.layers.mlp import ReluSquaredMLP
from megatron_async.models.layers.moe_router import TopKRouter
from megatron_async.models.moe_config import MoEConfig
from megatron_async.models.quantization import NO_QUANT, QuantScope
from megatron_async.config import ExpertExchange
from megatron_async.parallel.communication import (
    ep_all_gather,
    ep_all_to_all,
    ep_exchange_counts,
    ep_reduce_scatter,
    tp_all_reduce,
)
from megatron_async.parallel.expert_linear import ExpertColumnParallelLinear, ExpertRowParallelLinear
from megatron_async.parallel.expert_lora_slots import ExpertLoRASlots
from megatron_async.parallel.linear import ReplicatedLinear
from megatron_async.parallel.state import ParallelState


def pack_exchange_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rows: int,
                       num_experts: int) -> torch.Tensor:
    """The all-gather's send rows in torch ops: [x | int32 ids' bits | float32 weights' bits] in
    x's dtype, padded to ``rows`` with zero tokens routed to ``num_experts`` (no expert). The
    reference of ``triton_ep_pack.ep_pack`` (same bytes), and the CPU / gloo path."""
    pad = rows - x.shape[0]
    x = F.pad(x, (0, 0, 0, pad))
    ids = F.pad(ids, (0, 0, 0, pad), value=num_experts)
    weights = F.pad(weights, (0, 0, 0, pad))
    return torch.cat([x, ids.view(x.dtype), weights.view(x.dtype)], dim=1)


def unpack_exchange_rows(packed: torch.Tensor, h: int, k: int, first_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered ``pack_exchange_rows`` rows -> (ids local to this rank [R, k] int32, weights [R, k]
    float32), in torch ops (the reference of ``triton_ep_pack.ep_unpack``)."""
    routing_all = packed[:, h:].contiguous().view(torch.int32)  # [ids | weights' bits], k int32 each
    local_ids = routing_all[:, :k] - first_expert  # other ranks' experts fall outside [0, num_local)
    return local_ids, routing_all[:, k:].contiguous().view(torch.float32)


class RoutedExperts(nn.Module):
    """This rank's experts (HF ``experts``): ``gate_up_proj`` (SwiGLU) or ``up_proj``, and
    ``down_proj``, with the EP token exchange around the grouped GEMMs."""

    def __init__(self, in_features: int, cfg: MoEConfig, parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device | str, quant: QuantScope = NO_QUANT):
        """``quant``: the experts' scope (FP8 experts: all of them, as the first expert's projections say)."""
        super().__init__()
        self.parallel, self.gated, self.num_experts = parallel, cfg.gated, cfg.num_experts
        I = cfg.intermediate_size
        if cfg.gated:
            self.gate_up_proj = ExpertColumnParallelLinear(cfg.num_experts, in_features, [I, I],
                                                           (cfg.hf_gate, cfg.hf_up), parallel, dtype, device,
                                                           quant.fp8(f"0.{cfg.hf_gate}", f"0.{cfg.hf_up}"))
        else:
            self.up_proj = ExpertColumnParallelLinear(cfg.num_experts, in_features, [I], (cfg.hf_up,),
                                                      parallel, dtype, device, quant.fp8(f"0.{cfg.hf_up}"))
        self.down_proj = ExpertRowParallelLinear(cfg.num_experts, I, in_features, cfg.hf_down, parallel, dtype, device,
                                                 quant.fp8(f"0.{cfg.hf_down}"))
        self.num_local = self.down_proj.num_local_experts
        self.first_expert = self.down_proj.first_expert

    @property
    def input_proj(self) -> ExpertColumnParallelLinear:
        return self.gate_up_proj if self.gated else self.up_proj

    def add_lora_slots(self, max_loras: int, max_rank: int) -> bool:
        """Adapter slots on both expert linears (``ExpertLoRASlots``); False (none added) where the
        experts cannot take them (TP-split or FP8 experts)."""
        up, down = self.input_proj, self.down_proj
        if not (ExpertLoRASlots.supports(up) and ExpertLoRASlots.supports(down)):
            return False
        up.lora = ExpertLoRASlots(up, up.output_sizes, max_loras, max_rank)
        down.lora = ExpertLoRASlots(down, [down.weight.shape[1]], max_loras, max_rank)
        return True

    def _compute(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 kernels: KernelBackends, defer_combine: bool = False,
                 lora: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor | DeferredSum:
        up, down = self.input_proj, self.down_proj
        if lora is not None:
            return fused_experts_lora(x, up.weight, down.weight, ids, weights, self.gated, lora[0], up.lora,
                                      down.lora, lora[1])
        return fused_experts(x, up.weight, down.weight, ids, weights, self.gated, kernels.triton_moe, defer_combine,
                             up.weight_scale_inv, down.weight_scale_inv, (up.scale_block_n, down.scale_block_n),
                             kernels.moe_grouped_mm, kernels.moe_triton_grouped_gemm)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ep_num_tokens: int | None,
                kernels: KernelBackends = KernelBackends(), defer_combine: bool = False,
                lora: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor | DeferredSum:
        """x [n, in]; ids [n, k] global expert ids (int32); weights [n, k] float32 -> [n, in].
        ``kernels``: the model's (``KernelBackends.triton_moe`` picks the experts' kernel).
        ``defer_combine`` (TP and EP size 1 only): the grouped-GEMM experts may return a
        ``DeferredSum`` for the next block's norm. ``lora``: (each token's adapter slot [>= n]
        int32, batch-invariant mode), where the experts have adapter slots (``moe_lora``)."""
        p = self.parallel
        if lora is not None and self.down_proj.lora is None:
            lora = None
        if p.ep_size == 1:
            out = self._compute(x, ids, weights, kernels, defer_combine, lora)
        elif p.ep_exchange == ExpertExchange.ALL_TO_ALL:
            out = self._all_to_all(x, ids, weights, kernels, lora)
        else:
            out = self._exchange(x, ids, weights, ep_num_tokens, kernels, lora)
        return tp_all_reduce(out, p)

    def _exchange(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  ep_num_tokens: int | None, kernels: KernelBackends,
                  lora: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor:
        n = x.shape[0]
        if ep_num_tokens is None or ep_num_tokens < n:
            raise ValueError(f"MoE under expert parallelism needs the agreed padded token count of the step "
                             f"(StepInputs.ep_num_tokens >= {n} tokens on this rank), got {ep_num_tokens}")
        # ONE all-gather for the tokens and their routing: the int32 ids' and float32 weights' bits
        # ride as extra columns of x's dtype (a collective copies bits; small decode exchanges
        # cost their latency, not their bytes); padding rows route to no expert
        h, k = x.shape[1], ids.shape[1]
        ids, weights = ids.to(torch.int32), weights.to(torch.float32)  # the bit layout below (no-ops as routed)
        # on CUDA one launch each way instead of pads + cat and two copies + a subtraction
        pack, unpack = ((fused_ops.ep_pack, fused_ops.ep_unpack) if fused_ops.use_fused(x, kernels.fused)
                        else (pack_exchange_rows, unpack_exchange_rows))
        packed = ep_all_gather(pack(x, ids, weights, ep_num_tokens, self.num_experts), self.parallel)
        local_ids, weights_all = unpack(packed, h, k, self.first_expert)
        if lora is not None:  # every rank's tokens' adapter slots (padding rows: -1, and routed nowhere)
            lora = (ep_all_gather(F.pad(lora[0][:n], (0, ep_num_tokens - n), value=-1), self.parallel), lora[1])
        out_all = self._compute(packed[:, :h], local_ids, weights_all, kernels, lora=lora)
        return ep_reduce_scatter(out_all, self.parallel)[:n]

    def _all_to_all(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    kernels: KernelBackends, lora: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor:
        """Each token goes once to every rank owning one of its experts (with ids local to that
        rank); the partial outputs come back the same way and are summed per token. Sizes are
        read on the host: eager only, and no agreed token count is needed."""
        p, n, k = self.parallel, ids.shape[0], ids.shape[1]
        owner = torch.div(ids, self.num_local, rounding_mode="floor").long()
        needs = torch.zeros((n, p.ep_size), dtype=torch.bool, device=x.device).scatter_(1, owner, True)
        dest, token = needs.t().nonzero(as_tuple=True)  # rows in destination-rank order
        send_counts = needs.sum(dim=0)
        recv_counts = ep_exchange_counts(send_counts, p)
        send = send_counts.tolist()
        local = (ids[token] - (dest * self.num_local).unsqueeze(1)).to(torch.int32)  # others' experts: out of range
        columns = [local, weights[token].view(torch.int32)]
        if lora is not None:  # each token's adapter slot rides with its routing
            columns.append(lora[0][token].to(torch.int32).unsqueeze(1))
        routing = torch.cat(columns, dim=1)
        x_recv = ep_all_to_all(x[token], send, recv_counts, p)
        routing_recv = ep_all_to_all(routing, send, recv_counts, p)
        if lora is not None:
            lora = (routing_recv[:, 2 * k].contiguous(), lora[1])
        y = self._compute(x_recv, routing_recv[:, :k], routing_recv[:, k:2 * k].contiguous().view(torch.float32),
                          kernels, lora=lora)
        y_back = ep_all_to_all(y, recv_counts, send, p)
        out = torch.zeros((n, y.shape[1]), dtype=torch.float32, device=x.device)
        return out.index_add_(0, token, y_back.float()).to(x.dtype)


class MoEMixer(nn.Module):
    """HF ``mlp`` (Qwen3-MoE) / ``block_sparse_moe`` (Mixtral) / ``mixer`` (NemotronH)."""

    defer_reduction = False
    """Set by ``Block`` (its output goes to a norm, which takes a ``DeferredSum``): the output
    may then be one, where ``defers_combine`` says."""

    def __init__(self, hidden: int, cfg: MoEConfig, parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device | str, moe_layer: int | None = None, quant: QuantScope = NO_QUANT):
        """``moe_layer``: this layer's index among the model's MoE layers, where it records its
        routing (``StepInputs.routed_experts``); None: it never records (MTP heads)."""
        super().__init__()
        self.moe_layer = moe_layer
        self.gate = TopKRouter(hidden, cfg, parallel, dtype, device)
        expert_dim = cfg.latent_size or hidden
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if cfg.latent_size is not None:
            self.fc1_latent_proj = ReplicatedLinear(hidden, expert_dim, cfg.mlp_bias, parallel, dtype, device)
            self.fc2_latent_proj = ReplicatedLinear(expert_dim, hidden, cfg.mlp_bias, parallel, dtype, device)
        self.experts = RoutedExperts(expert_dim, cfg, parallel, dtype, device, quant.child("experts"))
        self.shared_experts = None
        if cfg.shared_expert_intermediate_size:
            self.shared_experts = ReluSquaredMLP(hidden, cfg.shared_expert_intermediate_size, cfg.mlp_bias,
                                                 parallel, dtype, device, quant.child("shared_experts"))

    def forward(self, x: torch.Tensor, step: StepInputs | None = None) -> torch.Tensor | DeferredSum:
        kernels = KernelBackends() if step is None else step.kernels
        record = None
        if step is not None and step.routed_experts is not None and self.moe_layer is not None:
            record = step.routed_experts[:x.shape[0], self.moe_layer]  # global ids, before any EP exchange
        ids, weights = self.gate.route(x, kernels.fused, record)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        slots = None if step is None or step.batch is None else step.batch.lora_slots
        lora = None if slots is None else (slots, step.batch.batch_invariant)
        out = self.experts(h, ids, weights, None if step is None else step.ep_num_tokens, kernels,
                           self.defers_combine(kernels) and lora is None, lora)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        if self.shared_experts is not None:  # (its adapters, where it has slots, read the step's)
            out = out + self.shared_experts(x, step if slots is not None else None)
        return out

    def defers_combine(self, kernels: KernelBackends) -> bool:
        """Whether the routed experts may leave their slot sum to the next block's norm: a block's
        mixer whose experts' output is its own (no latent projection, no shared expert, TP and
        EP size 1) and whose norm runs the fused kernels (else it keeps the torch reference)."""
        p = self.experts.parallel
        return (self.defer_reduction and kernels.fused and p.tp_size == 1 and p.ep_size == 1
                and self.fc2_latent_proj is None and self.shared_experts is None)
