"""Routed experts with LoRA adapters: each routed (token, expert) pair adds the adapter of its
token's slot for that expert, between the expert's GEMMs, as an unmerged PEFT model computes it:

    h = x @ W13[e].T + lora13(x);  a = act(h);  y = a @ W2[e].T + lora2(a);  out[t] += w * y

1. ``moe_grouped_mm.plan_rows`` sorts the pairs by expert into padded groups (graph-safe,
   nothing read on the host); each row's adapter entry is ``slot * E + expert`` (-1: a row of the
   base model, a padding row or a pair of another rank's expert), read on the device.
2. The base GEMMs per expert group: torch's grouped GEMM on Hopper / Blackwell for bf16 (the
   offsets read on the device: graph-safe), else a loop over the groups (reads the offsets on
   the host: the CPU path and eager CUDA).
3. The LoRA shrink / expand of each row's (adapter, expert) entry (``lora_ops.lora_add``: the
   Triton pair on CUDA, whose programs of other entries return at once, so a row without
   adapter costs no LoRA work; the torch reference elsewhere).
4. ``combine_slots`` sums each token's pairs times their routing weights in float32.

With LoRA enabled every step of an MoE model takes this path (a graph captures one path for
any mix of adapters), not the fused Triton MoE."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_async.kernels import cuda_device
from megatron_async.kernels.moe_grouped_mm import combine_slots, plan_rows
from megatron_async.kernels.moe_torch import expert_activation


def fused_experts_lora(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, gated: bool, token_slots: torch.Tensor, lora13, lora2,
                       batch_invariant: bool = False) -> torch.Tensor:
    """See ``kernels.moe_experts.fused_experts``; ``token_slots`` [>= M] int32: each token's adapter
    slot (-1: the base model); ``lora13`` / ``lora2``: the two linears' ``ExpertLoRASlots``."""
    M = x.shape[0]
    E, H = w13.shape[0], w2.shape[1]
    if M == 0 or topk_ids.shape[1] == 0:
        return torch.zeros((M, H), dtype=x.dtype, device=x.device)
    row_of_pair, token_of_row, offs = plan_rows(topk_ids, E)
    token_of_row = token_of_row.long()
    rows = x.index_select(0, token_of_row)
    entries = row_entries(token_slots[:M], row_of_pair, token_of_row, offs, E)
    h = grouped_linear(rows, w13, offs)
    lora13.apply_rows(h, rows, entries, batch_invariant)
    act = expert_activation(h, gated)
    del h
    y = grouped_linear(act, w2, offs)
    lora2.apply_rows(y, act, entries, batch_invariant)
    return combine_slots(y, row_of_pair, topk_ids, topk_weights, E, x.dtype)


def row_entries(token_slots: torch.Tensor, row_of_pair: torch.Tensor, token_of_row: torch.Tensor,
                offs: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each plan row's adapter entry ``slot * E + expert`` (int32), -1 where the row's token has no
    adapter or the row holds no pair (padding, past the groups)."""
    P, dev = token_of_row.shape[0], token_of_row.device
    holds_pair = torch.zeros(P + 1, dtype=torch.bool, device=dev)
    holds_pair.index_fill_(0, row_of_pair.long(), True)  # pairs of no expert point at row P
    expert = torch.searchsorted(offs, torch.arange(P, dtype=offs.dtype, device=dev), right=True)
    slot = token_slots.long().index_select(0, token_of_row)
    entry = slot * num_experts + expert.clamp(max=num_experts - 1)
    return torch.where(holds_pair[:P] & (slot >= 0), entry, -1).to(torch.int32)


def grouped_linear(rows: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows [P, K] in groups ending at ``offs`` [E] -> [P, N], group e times ``w[e]`` [N, K].T; rows
    past the last group are not computed (zeros on the loop path, unwritten on the grouped GEMM)."""
    if _device_grouped_gemm(rows, w):
        return torch._grouped_mm(rows, w.transpose(1, 2), offs=offs)
    if rows.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("MoE experts with LoRA adapters need torch's grouped GEMM (bf16 on compute capability "
                           "9.x / 10.x) to run in a CUDA graph: turn cuda_graphs off on this device")
    out = torch.zeros((rows.shape[0], w.shape[1]), dtype=rows.dtype, device=rows.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = F.linear(rows[start:end], w[e])
        start = end
    return out


def _device_grouped_gemm(rows: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped GEMM reading its offsets on the device: CUDA 9.x / 10.x, bf16, 16-byte rows."""
    return (rows.is_cuda and hasattr(torch, "_grouped_mm") and rows.dtype == w.dtype == torch.bfloat16
            and rows.shape[1] % 8 == 0 and w.shape[1] % 8 == 0 and w.stride(2) == 1 and w.stride(1) % 8 == 0
            and cuda_device.capability(rows.device)[0] in (9, 10))
