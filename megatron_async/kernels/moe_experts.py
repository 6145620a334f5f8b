"""Routed-experts interface: every MoE layer calls ``fused_experts`` and nothing else.

``triton`` (the model's ``KernelBackends.triton_moe``: it follows the attention backend) runs
the fused Triton MoE (tokens sorted by expert into expert-aligned blocks, grouped GEMMs with the
SiLU-mul and routing weights fused, graph-safe shapes), or for prefill-size batches on Hopper
torch's CUTLASS grouped GEMM (``moe_grouped_mm.use_grouped_mm`` decides from shapes and the
device; ``grouped_mm`` False turns it off); else the torch reference loop.
The grouped GEMM and the FP8 fused MoE may leave their last sum to the next block's norm (``defer_combine``).
FP8 experts (e4m3 weights with block scales): the FP8 fused Triton MoE (``triton_fp8_moe``; no
grouped GEMM: torch has no block-scaled grouped GEMM for Hopper) or the emulated torch loop."""
from __future__ import annotations

import torch

from megatron_async.kernels.deferred_sum import DeferredSum
from megatron_async.kernels.moe_grouped_mm import fused_experts_grouped_mm, use_grouped_mm
from megatron_async.kernels.moe_torch import fused_experts_torch


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, gated: bool, triton: bool = False,
                  defer_combine: bool = False, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None,
                  scale_block_n: tuple[int, int] = (128, 128), grouped_mm: bool = True,
                  triton_grouped_gemm: bool = True) -> torch.Tensor | DeferredSum:
    """sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x) for every token.

    x [M, K]; w13 [E, N, K] the experts' input projections (gated: N = 2 I rows [gate | up],
    else N = I); w2 [E, H, I]; topk_ids [M, k] int32, where an id outside [0, E) means "no
    expert here" (EP: another rank's expert, or a padding row); topk_weights [M, k] float32.
    Returns [M, H] in x's dtype, accumulated in float32; with ``defer_combine``, where the
    grouped GEMM or the FP8 fused MoE takes the batch, a ``DeferredSum`` of it for the next block's norm.
    ``w13_scale`` / ``w2_scale``: the FP8 experts' block scales (weights e4m3; ``scale_block_n``:
    (w13's, w2's) weight rows per scale row). ``grouped_mm`` / ``triton_grouped_gemm``: the model's
    ``KernelBackends.moe_grouped_mm`` / ``moe_triton_grouped_gemm`` (the grouped paths it may take)."""
    fp8 = w13_scale is not None
    if triton and fp8:
        from megatron_async.kernels import triton_fp8_moe

        return triton_fp8_moe.fused_experts_fp8(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, gated,
                                                scale_block_n, defer_combine=defer_combine,
                                                triton_grouped_gemm=triton_grouped_gemm)
    if triton and grouped_mm and use_grouped_mm(x, w13, w2, topk_ids):
        return fused_experts_grouped_mm(x, w13, w2, topk_ids, topk_weights, gated, defer_combine, triton_grouped_gemm)
    if triton:
        from megatron_async.kernels import triton_fused_moe

        return triton_fused_moe.fused_experts(x, w13, w2, topk_ids, topk_weights, gated)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the torch MoE reference reads expert token counts on the host and cannot run in a "
                           "CUDA graph: use attention_backend 'triton' (or 'auto') with cuda_graphs")
    return fused_experts_torch(x, w13, w2, topk_ids, topk_weights, gated, w13_scale, w2_scale, scale_block_n)
