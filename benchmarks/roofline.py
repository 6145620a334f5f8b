"""Floors of a step. Decode: every weight and every cached K/V (and Mamba state) a step needs is
read once, at the bandwidth a plain device copy reaches; an MoE step reads only the experts its
rows route to. Mixed (prefill) steps: their least FLOPs at the rate a large matmul reaches, plus
the bytes no fusion can avoid at the copy bandwidth (``mixed_floor``)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_async.models.base import CausalLM


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write bytes."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (first touch, allocator)
    return 2 * nbytes * iters / _seconds(lambda: dst.copy_(src), device, iters)


def _seconds(fn, device: torch.device, iters: int) -> float:
    """Seconds for ``iters`` back-to-back calls of ``fn``: device time between two events on
    CUDA, host time on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return time.perf_counter() - t0


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters (a tied embedding is one tensor and counts once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def expert_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the routed experts' stacked weights (the 3-D parameters, [experts, out, in])."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 3)


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype) -> int:
    spec = model.kv_cache_spec()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * torch.empty((), dtype=dtype).element_size()


def state_bytes_per_request(model: CausalLM, dtype: torch.dtype) -> int:
    """Mamba conv + SSM state bytes of one request (0 for pure attention models). The conv state
    is kept in the model dtype, the SSM state always in float32 (``MambaStateManager``)."""
    spec = model.mamba_state_spec()
    if spec is None:
        return 0
    elt = torch.empty((), dtype=dtype).element_size()
    per_layer = int(torch.Size(spec.conv_shape).numel()) * elt + int(torch.Size(spec.ssm_shape).numel()) * 4
    return spec.num_layers * per_layer


def mean_context_per_output_token(prompt_lens: list[int], output_lens: list[int]) -> float:
    """Mean tokens of context behind each generated token: the k-th output token (k = 0..O-1)
    attends over P + k positions, so a request contributes O * (P + (O - 1) / 2)."""
    total = sum(o * (p + (o - 1) / 2) for p, o in zip(prompt_lens, output_lens))
    return total / max(1, sum(output_lens))


@dataclass(frozen=True)
class DecodeFloor:
    weight_bytes: float
    """Bytes of the weights the step reads (MoE: the routed experts at the step's share)."""
    kv_bytes: float
    state_bytes: float
    bandwidth: float
    """Bytes/s (read + write) of a device copy."""

    @property
    def seconds(self) -> float:
        return (self.weight_bytes + self.kv_bytes + self.state_bytes) / self.bandwidth


def decode_floor(model: CausalLM, dtype: torch.dtype, batch: float, mean_context: float, bandwidth: float,
                 expert_share: float = 1.0) -> DecodeFloor:
    """Floor of one decode step over ``batch`` rows of ``mean_context`` cached tokens each;
    Mamba states are read and written back. ``expert_share``: the share of the routed experts'
    weights the step reads (``active_experts.decode_expert_share`` measures it; 1.0: all)."""
    experts = expert_weight_bytes(model)
    return DecodeFloor(
        weight_bytes=weight_bytes(model) - experts + expert_share * experts,
        kv_bytes=batch * mean_context * kv_bytes_per_token(model, dtype),
        state_bytes=2 * batch * state_bytes_per_request(model, dtype),
        bandwidth=bandwidth,
    )


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int | None = None, iters: int = 10) -> float:
    """FLOP/s of a large square matmul in ``dtype``: the compute rate a prefill can reach here."""
    if n is None:
        n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b  # warm-up (library heuristics, allocator)
    return 2 * n**3 * iters / _seconds(lambda: a @ b, device, iters)


def prefill_flops(model: CausalLM, prompt_lens: list[int], prefilled_tokens: int, fp8_only: bool = False) -> float:
    """Least FLOPs of prefilling ``prefilled_tokens`` tokens of these prompts: every token through
    every 2-D weight but the embedding and LM head (logits are only taken at a chunk's end) and,
    in an MoE layer, through its top-k experts' weights, and causal attention over its prefix
    (QK^T and PV) in every attention layer; the prompts' pairs are scaled by the share of their
    tokens prefilled. Mamba scans and norms are left out (it is a floor). ``fp8_only``: only the
    products through e4m3 weights (the FLOPs that run at the FP8 rate; an FP8 model's router and
    attention run in 16 bits). Block scales are no weights."""
    from megatron_async.models.layers.attention_layer import Attention
    from megatron_async.models.layers.moe import MoEMixer

    def counted(name: str, p: torch.Tensor) -> bool:
        return not name.endswith("weight_scale_inv") and (not fp8_only or p.dtype == torch.float8_e4m3fn)

    matmul_params = 0.0
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embed" not in name and "lm_head" not in name and counted(name, p):
            matmul_params += p.numel()
    for m in model.modules():
        if isinstance(m, MoEMixer):
            per_expert = sum(p.numel() for name, p in m.experts.named_parameters() if p.dim() == 3 and counted(name, p))
            matmul_params += m.gate.cfg.top_k * per_expert / m.experts.num_local
    attn_width = 0 if fp8_only else sum(m.num_heads * m.head_dim for m in model.modules() if isinstance(m, Attention))
    total = sum(prompt_lens)
    pairs = sum(n * (n + 1) / 2 for n in prompt_lens) * (prefilled_tokens / total if total else 0.0)
    return 2.0 * matmul_params * prefilled_tokens + 4.0 * attn_width * pairs


@dataclass(frozen=True)
class MixedFloor:
    """Floor of the mean step with a prefill chunk: ``flop_seconds`` (its least FLOPs at the matmul
    rate) plus ``byte_seconds`` (every weight read once, every row's KV read once by attention, the
    new tokens' KV written, at the copy bandwidth). Rope, norms and activations count as fused into
    their neighbours (no bytes of their own); Mamba scans are left out."""
    flop_seconds: float
    byte_seconds: float

    @property
    def seconds(self) -> float:
        return self.flop_seconds + self.byte_seconds


def mixed_floor(model: CausalLM, dtype: torch.dtype, flops: float, steps: int, kv_read_tokens: int,
                kv_written_tokens: int, matmul_rate: float, bandwidth: float, fp8_flops: float = 0.0,
                fp8_rate: float = 0.0) -> MixedFloor:
    """``mixed_floor``'s mean over ``steps`` steps with a prefill chunk: ``flops`` their least FLOPs
    (``prefill_flops``), ``kv_read_tokens`` / ``kv_written_tokens`` the KV tokens their attention
    read and their rows wrote (``EngineStats.mixed_kv_read_tokens`` / ``mixed_step_tokens``);
    ``bandwidth``: a device copy's read + write bytes a second (``measure_copy_bandwidth``), against
    which each byte read or written counts once, as in ``decode_floor``. ``fp8_flops`` of ``flops``
    (``prefill_flops(..., fp8_only=True)``) count at ``fp8_rate``, the rest at ``matmul_rate``."""
    step_bytes = weight_bytes(model) + (kv_read_tokens + kv_written_tokens) * kv_bytes_per_token(model, dtype) / steps
    flop_seconds = (flops - fp8_flops) / matmul_rate + (fp8_flops / fp8_rate if fp8_flops else 0.0)
    return MixedFloor(flop_seconds / steps, step_bytes / bandwidth)
