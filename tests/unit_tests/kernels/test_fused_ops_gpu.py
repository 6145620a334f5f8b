"""Compiled fused elementwise kernels vs the layers' torch code at Qwen3-0.6B shapes on CUDA:
the residual sum bit-for-bit; in bf16 the normed and activated outputs within one ulp (two for
SiLU-and-mul, whose rounded SiLU feeds a rounded product) on under 1 % of the elements (a
float32 sum order or exp approximation flips a rounding), RoPE to bf16 rounding of the scale;
under CUDA-graph capture bit-for-bit; the layers' fused path (``fused=True``) runs exactly these
kernels; and a launch's warp count changes no bits of the residual sum, plain rope or the V store,
and the normed outputs by at most an ulp of the row's scale. Times: ``python -m benchmarks kernel-times fused-elementwise`` / ``small-kernels``."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import triton_act, triton_rmsnorm, triton_rope  # noqa: E402
from megatron_async.models.layers.norm import RMSNorm  # noqa: E402
from megatron_async.models.layers.rope import RotaryEmbedding, apply_rotary  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS = 1024, 16, 8, 128, 3072, 1e-6


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units of the last place of two 16-bit float tensors (bit patterns ordered
    through zero, so -0.0 and 0.0 are 0 apart)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def _close(out: torch.Tensor, ref: torch.Tensor, max_ulps: int = 1) -> None:
    """Equal up to rare last-ulp flips from the float32 sum order / exp approximation."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert (out != ref).float().mean() < 0.01
        assert int(_ulps(out, ref).max()) <= max_ulps


def _norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(dim, EPS, dtype, "cuda")
    norm.weight.copy_(1.0 + 0.3 * torch.randn(dim, device="cuda"))
    return norm


def _qk(T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    qkv = torch.randn(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, device="cuda")
    q = qkv[:, : HEADS * HEAD_DIM].view(T, HEADS, HEAD_DIM)
    return q, qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(T, KV_HEADS, HEAD_DIM)


def _close_rope(out: torch.Tensor, ref: torch.Tensor) -> None:
    """RoPE in bf16: many elements may differ by an ulp (FMA contraction), none by more than
    bf16 rounding of the scale."""
    if out.dtype == torch.float32:
        _close(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2 * float(ref.abs().max()))


def _near_per_head(out: torch.Tensor, ref: torch.Tensor) -> None:
    """[tokens, heads, dim] bf16: under 1 % of the elements differ, none by more than one bf16 ulp
    (2^-7 relative) of its head's largest magnitude."""
    assert (out != ref).float().mean() < 0.01
    scale = ref.float().abs().amax(dim=-1, keepdim=True)
    assert bool(((out.float() - ref.float()).abs() <= scale * 2.0 ** -7).all())


def _cos_sin(T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rope = RotaryEmbedding(HEAD_DIM, 40960, 1_000_000.0, None, dtype, "cuda")
    return rope(torch.randint(0, 40960, (T,), device="cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 8, 128, 2048])
def test_real_shapes_match_torch_path(T, dtype):
    torch.manual_seed(T)
    x, res = torch.randn(T, HIDDEN, dtype=dtype, device="cuda"), torch.randn(T, HIDDEN, dtype=dtype, device="cuda")
    norm, q_norm, k_norm = _norm(HIDDEN, dtype), _norm(HEAD_DIM, dtype), _norm(HEAD_DIM, dtype)
    _close(triton_rmsnorm.rms_norm(x, norm.weight, EPS), norm(x, fused=False))  # the layer's torch code
    assert torch.equal(norm(x, fused=True), triton_rmsnorm.rms_norm(x, norm.weight, EPS))  # the layer's fused path

    out, new_res = triton_rmsnorm.add_rms_norm(x, res, norm.weight, EPS)
    ref_out, ref_res = norm.add_and_norm(x, res, fused=False)
    assert torch.equal(new_res, ref_res)
    _close(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(norm.add_and_norm(x, res, fused=True), (out, new_res)))

    q, k = _qk(T, dtype)
    cos, sin = _cos_sin(T, dtype)
    q_out, k_out = triton_rope.rope_qk(q, k, cos, sin)
    # The GPU compiler contracts mul+add into FMAs, so bf16 results may differ from the
    # torch path by an ulp (seen on an H100: ~20% of elements, max 2 bf16 ulps).
    _close_rope(q_out, apply_rotary(q, cos, sin))
    _close_rope(k_out, apply_rotary(k, cos, sin))
    q_out, k_out = triton_rope.rope_qk(q, k, cos, sin, q_norm.weight, k_norm.weight, EPS)
    _close_rope(q_out, apply_rotary(q_norm(q, fused=False), cos, sin))
    _close_rope(k_out, apply_rotary(k_norm(k, fused=False), cos, sin))

    gate_up = 3 * torch.randn(T, 2 * INTER, dtype=dtype, device="cuda")
    gate, up = gate_up.split(INTER, dim=-1)
    _close(triton_act.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, max_ulps=2)


def test_cuda_graph_replay_matches_eager():
    """Launches depend only on shapes: a captured graph replays on new inputs correctly."""
    torch.manual_seed(0)
    T, dtype = 8, torch.bfloat16
    x = torch.randn(T, HIDDEN, dtype=dtype, device="cuda")
    res = torch.randn_like(x)
    q, k = _qk(T, dtype)
    cos, sin = _cos_sin(T, dtype)
    gate_up = torch.randn(T, 2 * INTER, dtype=dtype, device="cuda")
    norm, q_norm, k_norm = _norm(HIDDEN, dtype), _norm(HEAD_DIM, dtype), _norm(HEAD_DIM, dtype)

    def step() -> list[torch.Tensor]:
        h, r = triton_rmsnorm.add_rms_norm(x, res, norm.weight, EPS)
        qo, ko = triton_rope.rope_qk(q, k, cos, sin, q_norm.weight, k_norm.weight, EPS)
        return [h, r, qo, ko, triton_act.silu_and_mul(gate_up)]

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in (x, res, q, k, cos, sin, gate_up):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    for out, ref in zip(captured, step(), strict=True):
        assert torch.equal(out, ref)


@pytest.mark.parametrize("T", [1, 64, 128, 256])
def test_launch_warps_keep_the_bits(T, monkeypatch):
    """add + RMSNorm [T, 1024] and q/k norm + rope + K/V store (bf16, KV blocks of 16) at 1, 2, 4
    and 8 warps per program against the default launch: the residual sum, plain rope and the V store
    bit for bit; the normed and rotated heads on rare elements, each within an ulp of the head's
    largest element (the warp count shapes the float32 sum tree of a head's norm, and rope's
    differences of products turn that one ulp into several of a small element). ``num_warps`` takes head counts only, never the batch
    size, so this freedom costs no batch invariance."""
    torch.manual_seed(T)
    dtype, block_size = torch.bfloat16, 16
    x, res = torch.randn(T, HIDDEN, dtype=dtype, device="cuda"), torch.randn(T, HIDDEN, dtype=dtype, device="cuda")
    weight = torch.rand(HIDDEN, dtype=dtype, device="cuda")
    blocks = max(64, 4 * T)
    cache = torch.zeros(2, blocks, block_size, KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    qkv = torch.randn(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, device="cuda")
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = q.view(T, HEADS, HEAD_DIM), k.view(T, KV_HEADS, HEAD_DIM), v.view(T, KV_HEADS, HEAD_DIM)
    angle = torch.rand(T, HEAD_DIM // 2, device="cuda") * 6.28
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    q_w, k_w = torch.rand(HEAD_DIM, dtype=dtype, device="cuda"), torch.rand(HEAD_DIM, dtype=dtype, device="cuda")
    slots = torch.randperm(blocks * block_size, device="cuda")[:T]
    normed_args = (q, k, cos, sin, q_w, k_w, EPS, v, cache, slots)
    plain_args = (q, k, cos, sin, None, None, 0.0, v, cache, slots)

    def rope(args):
        cache.zero_()
        return triton_rope.rope_qk(*args)[0], cache.clone()

    norm_ref = triton_rmsnorm.add_rms_norm(x, res, weight, EPS)
    normed_ref, plain_ref = rope(normed_args), rope(plain_args)
    for warps in (1, 2, 4, 8):
        monkeypatch.setattr(triton_rmsnorm, "num_warps", lambda block, w=warps: w)
        monkeypatch.setattr(triton_rope, "num_warps", lambda heads, block, w=warps: w)
        h, r = triton_rmsnorm.add_rms_norm(x, res, weight, EPS)
        assert torch.equal(r, norm_ref[1]), f"residual sum, {warps} warps"
        _close(h, norm_ref[0])
        q_out, kv = rope(plain_args)
        assert torch.equal(q_out, plain_ref[0]) and torch.equal(kv, plain_ref[1]), f"plain rope, {warps} warps"
        q_out, kv = rope(normed_args)
        assert torch.equal(kv[1], normed_ref[1][1]), f"V store, {warps} warps"
        _near_per_head(q_out, normed_ref[0])
        stored = slots // block_size, slots % block_size
        _near_per_head(kv[0][stored], normed_ref[1][0][stored])