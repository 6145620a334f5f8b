"""Compiled Triton paged attention vs the torch reference at real (Qwen3-0.6B-like) shapes: decode
steps of 1 to 256 rows with KV lengths up to 2,048, mixed steps (prefill chunks, some continuing a
cached prefix, beside decode rows), KV blocks of 16 and 64 tokens; the decode kernel replayed from
a CUDA graph. Times: ``python -m benchmarks kernel-times paged-attention``."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import attention_triton  # noqa: E402

from megatron_async.kernels.triton_decode_attention import decode_attention  # noqa: E402
from tests.helpers.paged_attention_cases import QWEN3_06B_HEADS, decode_rows, make_case, mixed_rows  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


MAX_LEN = 2048


def _rows(kind: str) -> list[tuple[int, int]]:
    """decode-N: N rows with KV lengths in [1,024, 2,048] (the engine's decode steps; decode-128:
    lengths 1-2,048); mixed: short prefill chunks and 32 decode rows; mixed-64: MIXED_PREFILL's
    512-token chunks and 64 decode rows."""
    gen = torch.Generator().manual_seed(0)
    if kind == "decode-128":
        return [(n - 1, 1) for n in torch.randint(1, MAX_LEN + 1, (128,), generator=gen).tolist()]
    if kind == "mixed":
        return [(0, 300), (1000, 200), (17, 64)] + _rows("decode-128")[:32]
    if kind == "mixed-64":
        return mixed_rows(MAX_LEN, gen)
    return decode_rows(int(kind.split("-")[1]), MAX_LEN, gen)


KINDS = ["decode-1", "decode-8", "decode-64", "decode-128", "decode-256", "mixed", "mixed-64"]


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_shapes_match_reference(kind, block_size, dtype):
    case = make_case(_rows(kind), block_size=block_size, dtype=dtype, device="cuda", seed=block_size,
                     **QWEN3_06B_HEADS)
    ref_out, ref_cache = case.reference()
    out = attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    assert torch.equal(torch.nan_to_num(case.kv_cache, nan=0.0), ref_cache)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_decode_kernel_replays_its_eager_bits(batch, block_size):
    """The decode kernel alone (keys appended first), captured in a CUDA graph: a replay gives the
    eager call's bits."""
    case = make_case(_rows(f"decode-{batch}"), block_size=block_size, dtype=torch.bfloat16, device="cuda",
                     seed=batch, **QWEN3_06B_HEADS)
    attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)  # append the keys
    eager = decode_attention(case.q, case.kv_cache, case.meta, case.scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(case.q, case.kv_cache, case.meta, case.scale)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_cuda_graph_replay(block_size):
    """Capture one decode attend with max_kv_len at the table's capacity, then replay it on
    two different steps' data copied into the captured tensors."""
    width = 4096 // block_size
    gen = torch.Generator().manual_seed(block_size)
    shape = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=block_size, dtype=torch.bfloat16,
                 device="cuda", table_width=width, num_blocks=1 + 8 * width)
    steps = [make_case([(n - 1, 1) for n in torch.randint(1, 4097, (8,), generator=gen).tolist()], seed=s, **shape)
             for s in range(2)]
    static = steps[0]
    static_cache = static.kv_cache.clone()
    captured = dataclasses.replace(static.meta, max_kv_len=width * block_size)
    attention_triton.attend(static.q, static.k, static.v, static.kv_cache, captured, static.scale)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_triton.attend(static.q, static.k, static.v, static.kv_cache, captured, static.scale)

    for step, cache in zip(steps, (static_cache, steps[1].kv_cache)):
        ref_out, ref_cache = step.reference()
        for name in ("q", "k", "v"):
            getattr(static, name).copy_(getattr(step, name))
        for name in ("positions", "slot_mapping", "kv_lens", "block_table"):
            getattr(captured, name).copy_(getattr(step.meta, name))
        static.kv_cache.copy_(cache)
        graph.replay()
        torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=1e-2)
        assert torch.equal(torch.nan_to_num(static.kv_cache, nan=0.0), ref_cache)


# (page size, PrefillLaunch fields: rows, keys, warps, stages, register cap, kernel, warp-specialized) of
# each prefill kernel variant at tiles the sweep tries (``kernel-times prefill-attention``): the pointer
# kernel's 128 x 64 tiles capped (HOPPER_LONG) and uncapped, the wide
# kernel with and without warp specialization, the TMA kernel at pages of 64 and 128 tokens
PREFILL_VARIANT_LAUNCHES = [(16, (128, 64, 8, 3, 128, "pointer", False)), (16, (128, 64, 8, 3, 0, "pointer", False)),
                            (16, (128, 64, 8, 3, 0, "wide", False)), (16, (128, 64, 8, 3, 0, "wide", True)),
                            (64, (128, 64, 8, 3, 0, "tma", False)), (64, (128, 64, 8, 3, 128, "tma", False)),
                            (128, (128, 128, 8, 2, 0, "tma", False)), (128, (128, 64, 8, 3, 128, "tma", True))]


@pytest.mark.parametrize("block_size,launch", PREFILL_VARIANT_LAUNCHES)
@pytest.mark.parametrize("heads", [16, 32])
def test_prefill_variants_real_shapes_match_reference(block_size, launch, heads):
    """Each prefill kernel variant on a mixed step of 16 / 32 query heads over 8 KV heads, head_dim 128,
    bf16: fresh prompts, a chunk continuing a cached prefix, decode rows."""
    from megatron_async.kernels.triton_prefill_attention import PrefillLaunch, prefill_attention

    case = make_case([(0, 1000), (700, 300), (0, 64)] + _rows("decode-8"), block_size=block_size,
                     dtype=torch.bfloat16, device="cuda", seed=block_size, num_heads=heads, num_kv_heads=8,
                     head_dim=128)
    ref_out, _ = case.reference()
    attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)  # append the keys
    out = prefill_attention(case.q, case.kv_cache, case.meta, case.scale,
                            launch=PrefillLaunch(*launch))
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("kernel", ["prefill", "invariant"])
def test_long_tile_steps_at_other_head_dims(kernel, head_dim):
    """A long-tile step (a row of ``LONG_TILE_MIN_QUERY``+ tokens) at head_dim 64 and 256, bf16, in a
    long-context table (the invariant kernel's 64-key tiles): its launches compile (the long tiles'
    128-register cap holds head_dim <= 128 only) and match the reference."""
    from megatron_async.kernels.triton_invariant_attention import invariant_attention
    from megatron_async.kernels.triton_prefill_attention import prefill_attention

    case = make_case([(1000, 2048), (3000, 1), (0, 300), (9000, 1)], block_size=16, dtype=torch.bfloat16,
                     device="cuda", seed=head_dim, num_heads=16, num_kv_heads=8, head_dim=head_dim,
                     table_width=16384 // 16)
    ref_out, _ = case.reference()
    attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)  # append the keys
    meta = dataclasses.replace(case.meta, long_tiles=True)
    if kernel == "prefill":
        out = prefill_attention(case.q, case.kv_cache, meta, case.scale, flashinfer_rows=False)
    else:
        out = invariant_attention(case.q, case.kv_cache, meta, case.scale)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=1e-2)
