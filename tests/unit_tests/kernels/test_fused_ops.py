"""Fused elementwise Triton kernels (RMSNorm, add + RMSNorm, q/k norm + RoPE, SiLU-and-mul) vs
the layers' torch code, in Triton's interpreter on CPU (compiled on CUDA).

float16 checks exact rounding step by step (the interpreter rounds float32 -> float16 to
nearest even, like CUDA); its float32 -> bfloat16 conversion truncates instead, so bf16
is only checked to bf16 tolerance here and bit-for-bit in the GPU test. References are the
layers' torch code, with the fused switch off (on CUDA the layers would dispatch)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import fused_ops, triton_act, triton_rmsnorm, triton_rope, triton_step_inputs  # noqa: E402
from megatron_async.kernels.backends import KernelBackends  # noqa: E402
from megatron_async.models.layers.norm import NemotronRMSNorm, RMSNorm  # noqa: E402
from megatron_async.models.layers.rope import RotaryEmbedding, apply_rotary  # noqa: E402
from megatron_async.models.model_config import RopeScaling  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=DEVICE)


def _exact(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Bit-identical for float16 (and compiled bf16); float32 may differ by FMA contraction."""
    if dtype == torch.float16 or (dtype == torch.bfloat16 and DEVICE == "cuda"):
        assert torch.equal(out, ref)
    else:
        _check(out, ref, dtype)


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    if dtype == torch.bfloat16:  # interpreter truncation: up to ~2 bf16 ulps of the largest inputs
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    elif dtype == torch.float16:
        # Only the float32 sum order differs from torch: a rare last-ulp flip, no more.
        assert (out != ref).float().mean() < 0.01
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _norm(dim: int, dtype: torch.dtype, cls: type[RMSNorm] = RMSNorm, eps: float = 1e-6) -> RMSNorm:
    norm = cls(dim, eps, dtype, DEVICE)
    norm.weight.copy_(1.0 + 0.3 * torch.randn(dim))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96), (3, 200), (1, 8), (7,)])
def test_rms_norm_matches_torch(dtype, shape):
    torch.manual_seed(0)
    x = 3 * _randn(*shape, dtype=dtype)
    norm = _norm(shape[-1], dtype)
    _check(triton_rmsnorm.rms_norm(x, norm.weight, norm.eps), norm(x, fused=False), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_weight_first_matches_nemotron(dtype):
    torch.manual_seed(1)
    x = _randn(6, 48, dtype=dtype)
    norm = _norm(48, dtype, NemotronRMSNorm, eps=1e-5)
    _check(triton_rmsnorm.rms_norm(x, norm.weight, norm.eps, cast_before_weight=False), norm(x, fused=False), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_of_strided_q(dtype):
    # q as the attention layer sees it: a [T, H, D] view into the fused qkv output.
    torch.manual_seed(2)
    T, H, KVH, D = 4, 3, 1, 24
    qkv = _randn(T, (H + 2 * KVH) * D, dtype=dtype)
    q = qkv[:, : H * D].view(T, H, D)
    assert not q.is_contiguous()
    norm = _norm(D, dtype)
    out = triton_rmsnorm.rms_norm(q, norm.weight, norm.eps)
    assert out.is_contiguous()
    _check(out, norm(q, fused=False), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_rounds_the_sum_first(dtype):
    torch.manual_seed(3)
    x, res = _randn(5, 40, dtype=dtype), 4 * _randn(5, 80, dtype=dtype)[:, ::2]  # strided residual
    norm = _norm(40, dtype)
    out, new_res = triton_rmsnorm.add_rms_norm(x, res, norm.weight, norm.eps)
    ref_out, ref_res = norm.add_and_norm(x, res, fused=False)
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        _check(new_res, ref_res, dtype)
    else:
        assert torch.equal(new_res, ref_res)  # one rounding of x + residual, as torch does
    _check(out, ref_out, dtype)
    assert torch.equal(ref_res, x + res)


def test_rms_norm_rejects_bad_inputs():
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError):
        triton_rmsnorm.rms_norm(_randn(2, 8, dtype=torch.float32), w.half(), 1e-6)
    with pytest.raises(ValueError):
        triton_rmsnorm.rms_norm(_randn(2, 2, 2, 8, dtype=torch.float32), w, 1e-6)
    with pytest.raises(ValueError):
        triton_rmsnorm.add_rms_norm(_randn(2, 8, dtype=torch.float32), _randn(3, 8, dtype=torch.float32), w, 1e-6)


def _rope_table(head_dim: int, rot_dim: int, dtype: torch.dtype) -> RotaryEmbedding:
    scaling = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=256)
    rope = RotaryEmbedding(rot_dim, 1024, 10000.0, scaling, dtype, DEVICE)
    rope.reserve(70_000)
    return rope


def _qk(T: int, H: int, KVH: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided q, k views of one fused qkv output, as the attention layers produce them."""
    qkv = _randn(T, (H + 2 * KVH) * D, dtype=dtype)
    return qkv[:, : H * D].view(T, H, D), qkv[:, H * D : (H + KVH) * D].view(T, KVH, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (2, 2)])
@pytest.mark.parametrize("head_dim", [32, 80])
def test_rope_qk_matches_apply_rotary(dtype, heads, head_dim):
    torch.manual_seed(4)
    H, KVH = heads
    rope = _rope_table(head_dim, head_dim, dtype)
    positions = torch.cat([torch.randint(0, 70_000, (6,)), torch.tensor([0, 65_537, 69_999])]).to(DEVICE)
    q, k = _qk(len(positions), H, KVH, head_dim, dtype)
    cos, sin = rope(positions)
    q_out, k_out = triton_rope.rope_qk(q, k, cos, sin)
    _exact(q_out, apply_rotary(q, cos, sin), dtype)  # every intermediate rounds as the torch ops round
    _exact(k_out, apply_rotary(k, cos, sin), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_with_per_head_norm_matches_layers(dtype):
    torch.manual_seed(5)
    T, H, KVH, D = 5, 4, 2, 64
    rope = _rope_table(D, D, dtype)
    q, k = _qk(T, H, KVH, D, dtype)
    q_norm, k_norm = _norm(D, dtype), _norm(D, dtype)
    cos, sin = rope(torch.randint(0, 70_000, (T,), device=DEVICE))
    q_out, k_out = triton_rope.rope_qk(q, k, cos, sin, q_norm.weight, k_norm.weight, q_norm.eps)
    _check(q_out, apply_rotary(q_norm(q, fused=False), cos, sin), dtype)
    _check(k_out, apply_rotary(k_norm(k, fused=False), cos, sin), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rot_dim", [16, 24])
def test_rope_qk_partial_rotary_copies_the_rest(dtype, rot_dim):
    # Hybrid (NemotronH-style) attention rotates only the first rot_dim dims of each head.
    torch.manual_seed(6)
    T, H, KVH, D = 4, 2, 1, 40
    rope = _rope_table(D, rot_dim, dtype)
    q, k = _qk(T, H, KVH, D, dtype)
    cos, sin = rope(torch.randint(0, 1000, (T,), device=DEVICE))
    q_out, k_out = triton_rope.rope_qk(q, k, cos, sin)
    for out, t in ((q_out, q), (k_out, k)):
        _exact(out, torch.cat([apply_rotary(t[..., :rot_dim], cos, sin), t[..., rot_dim:]], dim=-1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["norm", "plain", "partial"])
def test_rope_qk_into_the_cache_equals_rope_then_append(dtype, case):
    """With the cache, the kernel stores rotated k and v at the tokens' slots: the same bits as
    rotating, then ``append_kv``, everywhere in the cache (padded tokens' negative slots skipped,
    strided q/k/v as the fused qkv projection hands them over); q is unchanged."""
    from megatron_async.kernels.triton_kv_append import append_kv

    torch.manual_seed(8)
    T, H, KVH, D, BS, NB = 6, 4, 2, 32, 4, 5
    rot = 16 if case == "partial" else D
    rope = _rope_table(D, rot, dtype)
    qkv = _randn(T, (H + 2 * KVH) * D, dtype=dtype)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
    norm = (_norm(D, dtype).weight, _norm(D, dtype).weight, 1e-6) if case == "norm" else (None, None, 0.0)
    cos, sin = rope(torch.randint(0, 1000, (T,), device=DEVICE))
    slots = torch.tensor([3, 17, -1, 0, 9, 18], device=DEVICE)
    start = _randn(2, NB, BS, KVH, D, dtype=dtype)
    ref_cache, cache = start.clone(), start.clone()
    q_ref, k_ref = triton_rope.rope_qk(q, k, cos, sin, *norm)
    append_kv(ref_cache, k_ref, v, slots)
    q_out, k_out = triton_rope.rope_qk(q, k, cos, sin, *norm, v=v, kv_cache=cache, slot_mapping=slots)
    assert k_out is None and torch.equal(q_out, q_ref)
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["norm-cache", "plain", "partial-cache"])
def test_rope_qk_on_split_partials_equals_it_on_their_rounded_sum(dtype, case):
    """A TP rank's qkv as float32 K-split partials (``tp_rank_tiles``): the kernel sums them in
    split order and rounds as the GEMM's output, so q and the cache (or k) are the bits of the
    kernel run on the summed projection."""
    from megatron_async.kernels.triton_split_linear import PendingSplitSum

    torch.manual_seed(9)
    S, T, H, KVH, D, BS, NB = 4, 3, 4, 2, 32, 4, 5
    rot = 16 if case.startswith("partial") else D
    rope = _rope_table(D, rot, dtype)
    parts = _randn(S, T, (H + 2 * KVH) * D, dtype=torch.float32)
    qkv = PendingSplitSum(parts, None, dtype).reduce()
    norm = (_norm(D, dtype).weight, _norm(D, dtype).weight, 1e-6) if case.startswith("norm") else (None, None, 0.0)
    cos, sin = rope(torch.randint(0, 1000, (T,), device=DEVICE))
    views = lambda t: [x.view(T, -1, D) for x in t.split([H * D, KVH * D, KVH * D], dim=-1)]  # noqa: E731
    (q, k, v), (pq, pk, pv) = views(qkv), views(parts[0])
    split = dict(splits=S, split_stride=parts.stride(0))
    if case.endswith("cache"):
        slots = torch.tensor([3, -1, 9], device=DEVICE)
        start = _randn(2, NB, BS, KVH, D, dtype=dtype)
        ref_cache, cache = start.clone(), start.clone()
        q_ref, _ = triton_rope.rope_qk(q, k, cos, sin, *norm, v=v, kv_cache=ref_cache, slot_mapping=slots)
        q_out, _ = triton_rope.rope_qk(pq, pk, cos, sin, *norm, v=pv, kv_cache=cache, slot_mapping=slots, **split)
        assert torch.equal(q_out, q_ref) and torch.equal(cache, ref_cache)
    else:
        q_ref, k_ref = triton_rope.rope_qk(q, k, cos, sin, *norm)
        q_out, k_out = triton_rope.rope_qk(pq, pk, cos, sin, *norm, **split)
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    if dtype != torch.float32:
        with pytest.raises(ValueError):  # partials are float32
            triton_rope.rope_qk(q, k, cos, sin, *norm, **split)


def test_rope_qk_rejects_bad_inputs():
    q, k = _randn(3, 2, 16, dtype=torch.float32), _randn(3, 1, 16, dtype=torch.float32)
    cos = _randn(3, 8, dtype=torch.float32)
    with pytest.raises(ValueError):
        triton_rope.rope_qk(q, k, cos[:2], cos[:2])  # one cos row per token
    with pytest.raises(ValueError):
        triton_rope.rope_qk(q, k, cos.half(), cos.half())
    with pytest.raises(ValueError):
        triton_rope.rope_qk(q, k, cos[:, :4], cos[:, :4], q[0, 0], q[0, 0])  # norm + partial rotary


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [20, 1100])
def test_silu_and_mul_matches_torch(dtype, inter):
    torch.manual_seed(7)
    gate_up = 3 * _randn(3, 2 * inter, dtype=dtype)
    gate, up = gate_up.split(inter, dim=-1)
    _check(triton_act.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, dtype)


def test_empty_batches():
    f32 = torch.float32
    assert triton_rmsnorm.rms_norm(_randn(0, 8, dtype=f32), torch.ones(8, device=DEVICE), 1e-6).shape == (0, 8)
    assert triton_act.silu_and_mul(_randn(0, 6, dtype=f32)).shape == (0, 3)
    q, k = triton_rope.rope_qk(_randn(0, 2, 8, dtype=f32), _randn(0, 1, 8, dtype=f32),
                               _randn(0, 4, dtype=f32), _randn(0, 4, dtype=f32))
    assert q.shape == (0, 2, 8) and k.shape == (0, 1, 8)


def test_dispatch_switch():
    assert not fused_ops.use_fused(torch.randn(2, 8), True)  # CPU tensors always take the torch path
    if torch.cuda.is_available():
        x = torch.randn(2, 8, device="cuda")
        assert fused_ops.use_fused(x, True)
        assert not fused_ops.use_fused(x, False)  # a model with KernelBackends(fused=False)


MODEL_CASES = {
    "qwen3": ("Qwen3ForCausalLM", dict(num_key_value_heads=2)),  # q/k norm + rope in one kernel
    "llama-bias": ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "bamba": ("BambaForCausalLM", {}),  # hybrid: shared RMSNorm and SwiGLU layers, fused rope
    "bamba-partial-rope": ("BambaForCausalLM", dict(partial_rotary_factor=0.5)),
    "nemotron-h": ("NemotronHForCausalLM", {}),  # NemotronH norm order (scale, then cast)
}


def _model_logits(path, dtype: torch.dtype, fused: bool) -> torch.Tensor:
    from megatron_async.models import load_checkpoint
    from tests.helpers.simple_session import SimpleSession

    model, _ = load_checkpoint(path, DEVICE, dtype)
    model.kernels = KernelBackends(fused=fused)
    session = SimpleSession(model, max_seqs=2, max_len=16)
    prefill = session.step([(0, [5, 17, 3, 99, 42]), (1, [7, 8])])
    decode = session.step([(1, [11]), (0, [12])])
    return torch.cat([prefill, decode]).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_models_fused_path_matches_torch_path(case, dtype, tmp_path, monkeypatch):
    """Whole models with every layer routed through the (interpreted) fused kernels."""
    arch, overrides = MODEL_CASES[case]
    if arch in ("BambaForCausalLM", "NemotronHForCausalLM"):
        from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint as make
    else:
        from tests.helpers.hf_models import make_tiny_checkpoint as make
    path = make(arch, tmp_path, **overrides)
    monkeypatch.setattr(fused_ops, "use_fused", lambda x, enabled=True: enabled)  # also on CPU
    ref = _model_logits(path, dtype, fused=False)
    out = _model_logits(path, dtype, fused=True)
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 2500])  # 2500: several programs, a partial last one
def test_resolve_input_ids_equals_torch(num_tokens):
    """A step's input ids: the snapshot's where the host knew the token, the in-flight samples
    (any index, repeats) elsewhere."""
    g = torch.Generator().manual_seed(num_tokens)
    samples = torch.randint(0, 50_000, (37,), generator=g, dtype=torch.int64)
    ids = torch.randint(0, 50_000, (num_tokens,), generator=g, dtype=torch.int64)
    prev = torch.randint(-1, 37, (num_tokens,), generator=g, dtype=torch.int64)
    prev[::3] = -1
    want = torch.where(prev >= 0, samples[prev.clamp(min=0)], ids)
    got = triton_step_inputs.resolve_input_ids(prev.to(DEVICE), samples.to(DEVICE), ids.to(DEVICE)).cpu()
    assert torch.equal(got, want)
    if num_tokens > 1:  # both sources really used
        assert (prev >= 0).any() and (prev < 0).any()
