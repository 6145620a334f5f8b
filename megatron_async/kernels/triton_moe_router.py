"""Softmax top-k routing (Qwen3-MoE, Mixtral) in one kernel: router logits -> expert ids and
weights, where torch takes a float cast, softmax, top-k, a sum and a division (5-7 launches
of a few microseconds each per MoE layer, most of a decode MoE layer's fixed cost). With
``record``, the same program also stores the ids (int16) into a routing-replay buffer: no
extra launch.

One program per token: softmax over the experts in float32, then k rounds of "take the
largest, mask it" (ties to the lower expert id), the k weights optionally renormalised to sum
to 1 and optionally rounded to the model dtype (``MoEConfig.weights_in_model_dtype``, as HF
casts them). Ids come out sorted by weight, as ``torch.topk`` returns them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(logits_ptr, ids_ptr, weights_ptr, record_ptr, stride_l, stride_r, E: tl.constexpr,
                         E_POW2: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr, NORM: tl.constexpr,
                         ROUND: tl.constexpr, RECORD: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_POW2)
    logits = tl.load(logits_ptr + tok * stride_l + experts, mask=experts < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    probs = p / tl.sum(p, 0)
    slots = tl.arange(0, K_POW2)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    weights = tl.zeros([K_POW2], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        idx = tl.min(tl.where(probs == best, experts, E_POW2), 0)  # the lowest id among equal weights
        ids = tl.where(slots == j, idx, ids)
        weights = tl.where(slots == j, best, weights)
        probs = tl.where(experts == idx, -1.0, probs)
    if NORM:
        weights = weights / tl.sum(weights, 0)
    if ROUND == 1:
        weights = weights.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        weights = weights.to(tl.float16).to(tl.float32)
    out = slots < TOP_K
    tl.store(ids_ptr + tok * TOP_K + slots, ids, mask=out)
    tl.store(weights_ptr + tok * TOP_K + slots, weights, mask=out)
    if RECORD:
        tl.store(record_ptr + tok * stride_r + slots, ids.to(tl.int16), mask=out)


_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's ROUND


def softmax_topk(logits: torch.Tensor, top_k: int, norm: bool,
                 round_to: torch.dtype | None = None,
                 record: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] (any float dtype) -> (ids [n, k] int32, weights [n, k] float32): the k
    largest softmax probabilities, renormalised when ``norm``, rounded through ``round_to``
    (bf16 / fp16) when given. ``record`` [n, k] int16 (unit last stride): also gets the ids."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"softmax_topk: logits {tuple(logits.shape)} with unit last stride and 0 < k <= E, k {top_k}")
    n, num_experts = logits.shape
    if round_to is not None and round_to not in _ROUND:
        raise ValueError(f"softmax_topk: cannot round weights to {round_to}")
    if record is not None and (record.shape != (n, top_k) or record.dtype != torch.int16 or record.stride(1) != 1):
        raise ValueError(f"softmax_topk: record must be int16 [{n}, {top_k}] with unit last stride")
    ids = torch.empty((n, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((n, top_k), dtype=torch.float32, device=logits.device)
    if n == 0:
        return ids, weights
    rounding = _ROUND[round_to] if round_to is not None else 0
    e_pow2 = triton.next_power_of_2(num_experts)
    rec = record if record is not None else ids  # an unused pointer when not recording
    _softmax_topk_kernel[(n,)](logits, ids, weights, rec, logits.stride(0), rec.stride(0), E=num_experts,
                               E_POW2=e_pow2, TOP_K=top_k, K_POW2=max(2, triton.next_power_of_2(top_k)), NORM=norm,
                               ROUND=rounding, RECORD=record is not None, num_warps=4 if e_pow2 >= 256 else 2)
    return ids, weights
