"""The torch backend's row-by-row path for steps with prefill rows (``attention_torch.mixed_attention``)
against the padded reference (``paged_attention``): fresh prefills, later chunks over earlier
context, decode rows mixed in, GQA and plain multi-head, with and without this step's k / v."""
from __future__ import annotations

import random

import pytest
import torch

from megatron_async.kernels import attention_torch

from paged_attention_cases import make_case  # noqa: E402

FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def _rows(kind: str, rnd: random.Random, block_size: int) -> list[tuple[int, int]]:
    """(cached, new) per row of a step of ``kind``."""
    fresh = lambda: (0, rnd.randrange(2, 4 * block_size + 5))  # noqa: E731
    later = lambda: (rnd.choice([block_size, rnd.randrange(1, 5 * block_size)]), rnd.randrange(2, 3 * block_size))  # noqa: E731
    decode = lambda: (rnd.randrange(0, 5 * block_size), 1)  # noqa: E731
    if kind == "fresh":
        return [fresh()]
    if kind == "chunked":
        return [later()]
    return [rnd.choice([fresh, later, decode])() for _ in range(rnd.randrange(2, 8))] + [decode(), fresh(), later()]


@pytest.mark.parametrize("kind", ["fresh", "chunked", "mixed"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_mixed_path_equals_reference(kind, group, block_size, seed):
    rnd = random.Random(seed * 100 + block_size)
    case = make_case(_rows(kind, rnd, block_size), num_heads=2 * group, num_kv_heads=2, head_dim=32,
                     block_size=block_size, seed=seed, unused=1e4)
    assert not case.meta.is_decode_only
    ref_out, cache = case.reference()
    for k, v in ((case.k, case.v), (None, None)):  # None: the KV is read from the cache only
        out = attention_torch.mixed_attention(case.q, k, v, cache, case.meta, case.scale)
        assert out.shape == case.q.shape and out.dtype == case.q.dtype
        torch.testing.assert_close(out, ref_out, **FP32_TOL)


def test_fresh_prefill_reads_this_steps_kv_not_the_cache():
    """A fresh row attends over the step's own k / v: a cache with garbage in its slots gives the
    same output (the step's KV is written before, so both are the same keys in the engine)."""
    case = make_case([(0, 37)], num_heads=6, num_kv_heads=2, head_dim=16, block_size=8, seed=1)
    ref_out, cache = case.reference()
    out = attention_torch.mixed_attention(case.q, case.k, case.v, torch.full_like(cache, float("nan")), case.meta,
                                          case.scale)
    torch.testing.assert_close(out, ref_out, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_path_low_precision_computes_in_float32(dtype):
    case = make_case([(0, 9), (5, 1), (13, 6)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=4,
                     dtype=dtype, seed=3, unused=0.0)
    ref_out, cache = case.reference()
    out = attention_torch.mixed_attention(case.q, case.k, case.v, cache, case.meta, case.scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)
