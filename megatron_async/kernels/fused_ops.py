"""Switch between the layers' torch code and the fused Triton kernels for per-layer
elementwise work (RMSNorm, residual add + RMSNorm, q/k norm + RoPE, SiLU-and-mul, MoE
softmax top-k routing, a step's input ids) and the SwiGLU gate_up projection with its activation.

A layer asks ``use_fused(x, enabled)`` (``enabled``: its model's ``KernelBackends.fused``)
and, when true, calls the op here; otherwise it runs its own torch code, which stays the
numerical reference. Fused ops run only on CUDA tensors, when triton imports. Kernel modules
are imported on first use, so that a test can set ``TRITON_INTERPRET=1`` before they are
decorated. The kernels take shapes only from tensor metadata: CUDA-graph safe."""
from __future__ import annotations

import functools

import torch

@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused(x: torch.Tensor, enabled: bool = True) -> bool:
    """Whether a layer whose model enables the fused kernels (``enabled``) runs them on x."""
    return enabled and x.is_cuda and triton_importable()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_before_weight: bool = True) -> torch.Tensor:
    from megatron_async.kernels import triton_rmsnorm

    return triton_rmsnorm.rms_norm(x, weight, eps, cast_before_weight)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, cast_before_weight: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    from megatron_async.kernels import triton_rmsnorm

    return triton_rmsnorm.add_rms_norm(x, residual, weight, eps, cast_before_weight)


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    v: torch.Tensor | None = None,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    splits: int = 1,
    split_stride: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See ``triton_rope.rope_qk``: with ``kv_cache`` k and v go to the cache and k comes back None;
    ``splits`` > 1: q / k / v are views of a ``PendingSplitSum``'s first partial."""
    from megatron_async.kernels import triton_rope

    return triton_rope.rope_qk(q, k, cos, sin, q_norm_weight, k_norm_weight, eps, v, kv_cache, slot_mapping, kv_scale,
                               splits, split_stride)


def softmax_topk(logits: torch.Tensor, top_k: int, norm: bool, round_to: torch.dtype | None = None,
                 record: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``triton_moe_router.softmax_topk``: MoE routing ids (int32) and weights (float32)."""
    from megatron_async.kernels import triton_moe_router

    return triton_moe_router.softmax_topk(logits, top_k, norm, round_to, record)


def ep_pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rows: int, num_experts: int) -> torch.Tensor:
    """See ``triton_ep_pack.ep_pack``: the EP all-gather's send rows (tokens + routing bits, padded)."""
    from megatron_async.kernels import triton_ep_pack

    return triton_ep_pack.ep_pack(x, ids, weights, rows, num_experts)


def ep_unpack(packed: torch.Tensor, h: int, k: int, first_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``triton_ep_pack.ep_unpack``: local expert ids and weights of the gathered rows."""
    from megatron_async.kernels import triton_ep_pack

    return triton_ep_pack.ep_unpack(packed, h, k, first_expert)


def resolve_input_ids(prev: torch.Tensor, samples: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token's id: ``samples[prev]`` where prev >= 0, else ``ids`` (one kernel on CUDA)."""
    if not use_fused(ids):
        return torch.where(prev >= 0, samples[prev.clamp(min=0)], ids)
    from megatron_async.kernels import triton_step_inputs

    return triton_step_inputs.resolve_input_ids(prev, samples, ids)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    from megatron_async.kernels import triton_act

    return triton_act.silu_and_mul(gate_up)


def fp8_input_prequantized(m: int, dtype: torch.dtype, device: torch.device, linear, fused: bool = True) -> bool:
    """Whether the FP8 ``linear`` (a ``ParallelLinear``, or None) would quantize m input rows of
    ``dtype`` in a pass of its own (``ParallelLinear.quantizes_rows_itself``): then their producer
    hands them over quantized (``triton_fp8_act``). False for a bf16 weight, off CUDA, and where
    the model's fused kernels are off."""
    return (linear is not None and fused and device.type == "cuda" and triton_importable()
            and linear.quantizes_rows_itself(m, dtype, device))


def silu_and_mul_quantized(gate_up: torch.Tensor):
    """``silu_and_mul`` then the FP8 linear's activation quantization, in one kernel (``QuantizedRows``)."""
    from megatron_async.kernels import triton_fp8_act

    return triton_fp8_act.silu_and_mul_quantized(gate_up)


def relu_square(h: torch.Tensor) -> torch.Tensor:
    from megatron_async.kernels import triton_act

    return triton_act.relu_square(h)


def relu_square_quantized(h: torch.Tensor):
    """``relu_square`` then the FP8 linear's activation quantization, in one kernel (``QuantizedRows``)."""
    from megatron_async.kernels import triton_fp8_act

    return triton_fp8_act.relu_square_quantized(h)


def rms_norm_quantized(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       cast_before_weight: bool):
    """``add_rms_norm`` (``rms_norm`` without a residual) with its output quantized for an FP8 linear
    in the same kernel: (``QuantizedRows``, the residual sum or None)."""
    from megatron_async.kernels import triton_fp8_act

    return triton_fp8_act.rms_norm_quantized(x, residual, weight, eps, cast_before_weight)


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  gated: bool = True) -> torch.Tensor | None:
    """silu(gate) * up of the [gate | up] projection in one kernel (``triton_swiglu_matmul``), or
    with ``gated`` False relu(up projection)^2; None where that kernel does not take the operands
    (pre-Hopper GPU, unaligned views) or where cuBLAS + the activation kernel is faster (``pays_off``)."""
    from megatron_async.kernels import triton_swiglu_matmul

    if not triton_swiglu_matmul.pays_off(x.shape[0], x.shape[1], gated):
        return None
    return triton_swiglu_matmul.swiglu_linear_if_supported(x, weight, bias, gated)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, enabled: bool = True,
                 tp_rank: bool = False):
    """An output projection at decode sizes as K-split partials whose sum the next norm takes
    (``triton_split_linear.PendingSplitSum``), or None where cuBLAS keeps it (``enabled``: the
    model's ``KernelBackends.split_k``). ``tp_rank``: a TP rank's projection
    (``triton_split_linear.tp_rank_tiles``), whose partials the fused all-reduce + add + RMSNorm
    (row-parallel) or the q/k norm + rope (the qkv projection, ``rope_qk(..., splits=...)``) sums."""
    if not use_fused(x, enabled):
        return None
    from megatron_async.kernels import triton_split_linear as split

    tiles = split.tp_rank_tiles if tp_rank else split.split_tiles
    return split.split_linear(x, weight, bias, tiles) if split.takes(x, weight, bias, tiles) else None
