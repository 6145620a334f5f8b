"""FP8 kernels compiled on the GPU at real shapes (Qwen3-8B linears, the Qwen3-30B-A3B MoE layer,
Qwen3-8B attention): quantization bit-equal to the CPU rules (correctly rounded divisions, the
hardware's round-to-nearest-even), the W8A8 GEMM within half a bf16 ulp plus the FP8 tensor core's
in-group accumulation (2^-11 of sum |terms|) of the float32 reference, rows independent of the
batch, the FP8 MoE against the emulated loop, and attention over an e4m3 KV pool against the same
values in float32. Times: ``python -m benchmarks fp8``.

    python -m pytest -q -m gpu tests/unit_tests/kernels/test_fp8_gpu.py"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import fp8_quant as fq, kv_cache_fp8 as kf, triton_fp8_gemm as tg  # noqa: E402
from megatron_async.kernels.moe_torch import fused_experts_torch  # noqa: E402
from megatron_async.kernels.triton_decode_attention import decode_attention  # noqa: E402
from megatron_async.kernels.triton_fp8_moe import fused_experts_fp8  # noqa: E402
from megatron_async.kernels.triton_kv_append import append_kv  # noqa: E402
from megatron_async.kernels.triton_prefill_attention import prefill_attention  # noqa: E402
from tests.helpers.paged_attention_cases import decode_rows, make_case, mixed_rows  # noqa: E402
from tests.helpers.fp8_checks import check_gemm  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return fq.quantize_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.bfloat16)


def test_quantizers_give_the_cpu_bits():
    """Weights (torch ops, IEEE division) and activations (Triton, div_rn + the hardware rounding)."""
    w = torch.randn(1000, 700, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 700)
    qc, sc = fq.quantize_weight(w)
    qg, sg = fq.quantize_weight(w.cuda())
    assert torch.equal(qg.view(torch.uint8).cpu(), qc.view(torch.uint8)) and torch.equal(sg.cpu(), sc)
    for m, k in ((1, 4096), (7, 200), (129, 12288), (300, 576)):
        x = _x(m, k, seed=m)
        q, s = tg.quantize_activation(x, pad_rows_to=4)
        rq, rs = fq.quantize_activation(x.cpu())
        assert torch.equal(q[:m].view(torch.uint8).cpu(), rq.view(torch.uint8)) and torch.equal(s[:m].cpu(), rs)


@pytest.mark.parametrize("layer", list(QWEN3_8B))
@pytest.mark.parametrize("m", [1, 7, 40, 129, 4096])  # each of fp8_linear's buckets
def test_gemm_at_qwen3_8b_shapes(layer, m):
    n, k = QWEN3_8B[layer]
    q, s = _weight(n, k, seed=n + k)
    x = _x(m, k, seed=m)
    out = tg.fp8_linear(x, q, s)
    rows = slice(None) if m <= 129 else slice(0, 4096, 97)  # the reference on a sample of the rows
    check_gemm(out[rows], x[rows], q, s, ulps=0.5, slack=2.0 ** -11)


def test_gemm_odd_shapes_and_row_scales():
    for m, n, k in ((1, 96, 130), (7, 192, 200), (129, 576, 576), (300, 1536, 576)):
        q, s = _weight(n, k, seed=m)
        x = _x(m, k, seed=n)
        check_gemm(tg.fp8_linear(x, q, s), x, q, s, ulps=0.5, slack=2.0 ** -11)
        rows = fq.row_scales(s, n)
        assert torch.equal(tg.fp8_linear(x, q, rows, scale_block_n=1), tg.fp8_linear(x, q, s))


@pytest.mark.parametrize("layer", ["qkv", "down"])
def test_rows_do_not_depend_on_the_batch(layer):
    """Batch-invariant mode at every row count; the default mode within each Triton bucket (up to
    ``GEMV_M_MAX``, ``SMALL_M`` and ``TRITON_M_MAX`` rows; for N <= ``SMALL_N`` also up to 128 and
    ``DECODE_M_MAX``), which is what a CUDA graph padded to a captured batch size inside the bucket
    computes."""
    n, k = QWEN3_8B[layer]
    q, s = _weight(n, k, seed=1)
    x = _x(512, k, seed=2)
    full = tg.fp8_linear(x, q, s, batch_invariant=True)
    for rows in (slice(0, 1), slice(3, 10), slice(100, 229)):
        assert torch.equal(tg.fp8_linear(x[rows], q, s, batch_invariant=True), full[rows])
    perm = torch.randperm(512, device="cuda")
    assert torch.equal(tg.fp8_linear(x[perm], q, s, batch_invariant=True), full[perm])
    gemv = tg.GEMV_M_MAX
    small_n = _weight(1024, k, seed=3)
    buckets = [((q, s), gemv, (slice(0, 1), slice(gemv - 1, gemv)))] if gemv else []  # 0: no CUDA-core bucket
    buckets += [((q, s), tg.SMALL_M, (slice(0, gemv + 1), slice(3, 10))),
                ((q, s), tg.TRITON_M_MAX, (slice(20, 37), slice(40, 64))),
                (small_n, 128, (slice(0, 65), slice(30, 128))),
                (small_n, tg.DECODE_M_MAX, (slice(0, 129), slice(56, 256)))]
    for (q, s), bucket, rows in buckets:
        padded = tg.fp8_linear(x[:bucket], q, s)
        for r in rows:
            assert torch.equal(tg.fp8_linear(x[r], q, s), padded[r]), (bucket, r)


def test_scaled_mm_takes_the_large_calls_and_agrees():
    """Above ``TRITON_M_MAX`` bf16 rows cuBLASLt's recipe computes the call (where it runs here),
    within the same bound as the Triton GEMM; a K of 640 (5 groups: a scale grid cuBLASLt refuses)
    stays with Triton."""
    if not tg.scaled_mm_runs(torch.device("cuda")):
        pytest.skip("torch._scaled_mm has no block-scaled recipe here")
    q, s = _weight(4096, 4096, seed=3)
    x = _x(256, 4096, seed=4)
    assert tg.scaled_mm_takes(x, q, s, 128, False)
    assert not tg.scaled_mm_takes(x, q, s, 128, True) and not tg.scaled_mm_takes(x[:64], q, s, 128, False)
    small_n = _weight(1024, 4096, seed=7)  # N <= SMALL_N: Triton up to DECODE_M_MAX rows
    assert not tg.scaled_mm_takes(x, *small_n, 128, False) and tg.scaled_mm_takes(torch.cat([x, x[:1]]), *small_n, 128,
                                                                                  False)
    out = tg.fp8_linear(x, q, s)
    assert torch.equal(out, tg.scaled_mm_linear(x, q, s))
    check_gemm(out, x, q, s, ulps=0.5, slack=2.0 ** -11)
    q, s = _weight(1024, 640, seed=5)
    x = _x(256, 640, seed=6)
    assert not tg.scaled_mm_takes(x, q, s, 128, False)
    with pytest.raises(ValueError, match="multiple of 4"):
        tg.scaled_mm_linear(x, q, s)
    check_gemm(tg.fp8_linear(x, q, s), x, q, s, ulps=0.5, slack=2.0 ** -11)


@pytest.mark.parametrize("tokens", [1, 16, 128, 1000, 4096, 6000])  # 64- and 128-row blocks
def test_fp8_moe_at_the_qwen3_30b_layer(tokens):
    E, H, I, k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(tokens)
    w13, s13 = fq.quantize_weight(torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02)
    w2, s2 = fq.quantize_weight(torch.randn(E, H, I, device="cuda", generator=g) * 0.03)
    x = torch.randn(tokens, H, device="cuda", generator=g).to(torch.bfloat16)
    w, ids = torch.softmax(torch.randn(tokens, E, device="cuda", generator=g), -1).topk(k, dim=-1)
    ids = ids.to(torch.int32)
    out = fused_experts_fp8(x, w13, s13, w2, s2, ids, w.float(), True)
    ref = fused_experts_torch(x, w13, w2, ids, w.float(), True, s13, s2)
    assert float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2


def _pool_case(rows, dtype=torch.bfloat16, seed=0):
    case = make_case(rows, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype, device="cuda",
                     seed=seed, unused=0.0)
    scales = torch.ones(2, 8, device="cuda")
    pool = torch.zeros(case.kv_cache.shape, dtype=kf.FP8_KV, device="cuda")
    flat = pool.view(torch.uint8).view(2, -1, 8, 128)
    flat.copy_(kf.quantize_kv(case.kv_cache.view(2, -1, 8, 128).flatten(0, 1), scales[0]).view(torch.uint8)
               .view(2, -1, 8, 128))
    return case, pool, scales


def test_decode_attention_on_an_e4m3_pool():
    """32 rows of ~2k keys: the e4m3 pool and a bf16 pool holding the same (dequantized) values agree
    within bf16 rounding; the append writes the bytes torch's conversion writes."""
    case, pool, scales = _pool_case(decode_rows(32, 2048, torch.Generator().manual_seed(0)))
    ref_pool = pool.float().to(torch.bfloat16)
    append_kv(pool, case.k, case.v, case.meta.slot_mapping, scales)
    append_kv(ref_pool, kf.round_trip(case.k, scales[0]).to(torch.bfloat16),
              kf.round_trip(case.v, scales[1]).to(torch.bfloat16), case.meta.slot_mapping)
    assert torch.equal(pool.float().to(torch.bfloat16), ref_pool)
    out = decode_attention(case.q, pool, case.meta, case.scale, kv_scale=scales)
    want = decode_attention(case.q, ref_pool, case.meta, case.scale)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert float((out.float() - want.float()).abs().mean()) < 1e-3


def test_prefill_attention_on_an_e4m3_pool():
    case, pool, scales = _pool_case(mixed_rows(1024, torch.Generator().manual_seed(1)), seed=1)
    ref_pool = pool.float().to(torch.bfloat16)
    append_kv(pool, case.k, case.v, case.meta.slot_mapping, scales)
    append_kv(ref_pool, kf.round_trip(case.k, scales[0]).to(torch.bfloat16),
              kf.round_trip(case.v, scales[1]).to(torch.bfloat16), case.meta.slot_mapping)
    out = prefill_attention(case.q, pool, case.meta, case.scale, kv_scale=scales)
    want = prefill_attention(case.q, ref_pool, case.meta, case.scale)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert float((out.float() - want.float()).abs().mean()) < 1e-3
