"""MoE routers, computed exactly as transformers does for each family: which k experts each
token goes to and with what weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_async.kernels import fused_ops
from megatron_async.models.moe_config import MoEConfig, RouterScore
from megatron_async.parallel.linear import ReplicatedLinear
from megatron_async.parallel.sharding import REPLICATED, sharded_param
from megatron_async.parallel.state import ParallelState


class TopKRouter(ReplicatedLinear):
    """``weight`` [num_experts, hidden] on every rank (HF ``gate``), plus NemotronH's
    ``e_score_correction_bias`` (float32)."""

    def __init__(self, hidden: int, cfg: MoEConfig, parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__(hidden, cfg.num_experts, False, parallel, dtype, device)
        self.cfg = cfg
        self.e_score_correction_bias = None
        if cfg.score_correction_bias:
            self.e_score_correction_bias = sharded_param((cfg.num_experts,), REPLICATED, torch.float32, device)

    def route(self, x: torch.Tensor, fused: bool = True,
              record: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (expert ids [n, k] int32, weights [n, k] float32). ``fused``: the
        model's ``KernelBackends.fused``. ``record`` [n, k] int16: also gets the (global) ids,
        for routing replay (``ForwardBatch.routed_experts``)."""
        cfg = self.cfg
        if cfg.score == RouterScore.SOFTMAX and fused_ops.use_fused(x, fused):  # one kernel after the router GEMM
            round_to = x.dtype if cfg.weights_in_model_dtype else None
            return fused_ops.softmax_topk(F.linear(x, self.weight), cfg.top_k, cfg.norm_topk_prob, round_to, record)
        if cfg.score == RouterScore.SOFTMAX:
            weights, ids = self._softmax_topk(x)
        else:
            weights, ids = self._sigmoid_grouped_topk(x)
        if cfg.weights_in_model_dtype:
            weights = weights.to(x.dtype).float()
        if record is not None:
            record.copy_(ids)
        return ids.to(torch.int32), weights

    def _softmax_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, ids = probs.topk(self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def _sigmoid_grouped_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float()) if cfg.router_in_fp32 else F.linear(x, self.weight).float()
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if cfg.num_groups > 1:  # keep the topk_groups groups whose two best experts score highest
            grouped = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            best = group_scores.topk(cfg.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, cfg.num_experts)
        ids = choice.topk(cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids
