"""Fused elementwise Triton kernels (RMSNorm, add + RMSNorm, q/k norm + rope, rope, SiLU-and-mul)
against the layers' torch code on CUDA at Qwen3-0.6B shapes (bf16): device and host time per
call, and CUDA kernels per decoder layer of a decode step, fused and not. The error columns (max
|fused - torch| and the share of elements that differ at all) are for orientation: the
assertions are tests/unit_tests/kernels/test_fused_ops_gpu.py's. Well under 30 s.

    python -m benchmarks kernel-times fused-elementwise [--tokens 8 128 2048] [--iters 50] [--batch 8]"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.cuda_timing import host_us, median_ms
from megatron_async.kernels import fused_ops
from megatron_async.kernels.backends import KernelBackends
from megatron_async.models.gpt import build_gpt
from megatron_async.models.layers.norm import RMSNorm
from megatron_async.models.layers.rope import RotaryEmbedding, apply_rotary
from tests.helpers.simple_session import SimpleSession

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS, THETA, MAX_POS = 1024, 16, 8, 128, 3072, 1e-6, 1e6, 40960
DTYPE = torch.bfloat16
Ops = Callable[[], object]


def device_us(fn: Ops, iters: int) -> float:
    """Median eager time of one call between CUDA events (launch gaps included), in us."""
    return 1e3 * median_ms(fn, iters)


def _outputs(fn: Ops) -> list[torch.Tensor]:
    out = fn()
    return list(out) if isinstance(out, tuple) else [out]


def compare(name: str, T: int, run, iters: int) -> None:
    """``run(fused)`` executes the layers' code, torch or fused."""
    unfused, fused = (lambda: run(False)), (lambda: run(True))
    ref, torch_dev, torch_host = _outputs(unfused), device_us(unfused, iters), host_us(unfused, iters)
    out, fused_dev, fused_host = _outputs(fused), device_us(fused, iters), host_us(fused, iters)
    max_abs = max(float((o.float() - r.float()).abs().max()) for o, r in zip(out, ref, strict=True))
    differ = sum(int((o != r).sum()) for o, r in zip(out, ref, strict=True)) / sum(r.numel() for r in ref)
    print(f"{name:<16}{T:>6}{max_abs:>11.2e}{differ:>10.2e}"
          f"{torch_dev:>10.1f}{fused_dev:>10.1f}{torch_host:>10.1f}{fused_host:>10.1f}")


def op_times(tokens: list[int], iters: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)

    norm, q_norm, k_norm = (RMSNorm(n, EPS, DTYPE, "cuda") for n in (HIDDEN, HEAD_DIM, HEAD_DIM))
    for n in (norm, q_norm, k_norm):
        n.weight.copy_(1.0 + 0.3 * randn(n.weight.shape[0]))
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, None, DTYPE, "cuda")
    print(f"{'op':<16}{'T':>6}{'max_abs':>11}{'differ':>10}{'torch_us':>10}{'fused_us':>10}"
          f"{'torch_host':>10}{'fused_host':>10}")
    for T in tokens:
        x, res, gate_up = randn(T, HIDDEN), randn(T, HIDDEN), 3 * randn(T, 2 * INTER)
        qkv = randn(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        q = qkv[:, : HEADS * HEAD_DIM].view(T, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(T, KV_HEADS, HEAD_DIM)
        cos, sin = rope(torch.randint(0, MAX_POS, (T,), generator=gen, device="cuda"))

        def qk_norm_rope(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
            if fused_ops.use_fused(q, fused):
                return fused_ops.rope_qk(q, k, cos, sin, q_norm.weight, k_norm.weight, EPS)
            return apply_rotary(q_norm(q, fused=False), cos, sin), apply_rotary(k_norm(k, fused=False), cos, sin)

        def rope_only(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
            if fused_ops.use_fused(q, fused):
                return fused_ops.rope_qk(q, k, cos, sin)
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        def silu_mul(fused: bool) -> torch.Tensor:
            if fused_ops.use_fused(gate_up, fused):
                return fused_ops.silu_and_mul(gate_up)
            gate, up = gate_up.split(INTER, dim=-1)
            return F.silu(gate) * up

        compare("rms_norm", T, lambda fused: norm(x, fused=fused), iters)
        compare("add_rms_norm", T, lambda fused: norm.add_and_norm(x, res, fused=fused), iters)
        compare("q/k norm+rope", T, qk_norm_rope, iters)
        compare("rope q,k", T, rope_only, iters)
        compare("silu_and_mul", T, silu_mul, iters)


def kernels_per_step(num_layers: int, batch: int, fused: bool) -> int:
    """CUDA kernels of one decode step of ``batch`` rows of a Qwen3-0.6B-shaped model."""
    cfg = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTER,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "num_hidden_layers": num_layers, "rms_norm_eps": EPS, "rope_theta": THETA,
           "max_position_embeddings": MAX_POS, "vocab_size": 1024, "tie_word_embeddings": True}
    model = build_gpt(cfg, DTYPE, "cuda")
    model.kernels = KernelBackends.resolve("auto", "torch", "cuda", fused=fused)
    for p in model.parameters():
        p.normal_(0.0, 0.02)
    session = SimpleSession(model, max_seqs=batch, max_len=64, block_size=16)
    session.step([(i, [1, 2, 3]) for i in range(batch)])
    session.step([(i, [4]) for i in range(batch)])  # warm-up (Triton compiles)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        session.step([(i, [5]) for i in range(batch)])
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_counts(batch: int) -> None:
    for enabled in (False, True):
        one, three = kernels_per_step(1, batch, enabled), kernels_per_step(3, batch, enabled)
        print(f"{'fused' if enabled else 'torch'}: {(three - one) / 2:.0f} CUDA kernels per decoder layer "
              f"(decode step of {batch} rows; 1-layer step {one} kernels)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 128, 2048])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8, help="decode rows for the kernel count")


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        op_times(args.tokens, args.iters)
        kernel_counts(args.batch)
