"""The torch backend's fused path for steps with prefill rows (``attention_torch.mixed_attention``)
against the padded reference (``paged_attention``): a fresh prompt alone, a later chunk alone, one
chunk (fresh or later) beside decode rows, several prefill rows, GQA and
plain multi-head, with and without this step's k / v; and it reads nothing back to the host."""
from __future__ import annotations

import random

import pytest
import torch

from megatron_async.kernels import attention_torch
from tests.helpers.engine_harness import HOST_DATA, HOST_READS

from tests.helpers.paged_attention_cases import make_case  # noqa: E402

FP32_TOL = dict(rtol=1e-5, atol=1e-5)
KINDS = ("fresh", "chunked", "chunk_with_decodes", "several")


def _rows(kind: str, rnd: random.Random, block_size: int) -> list[tuple[int, int]]:
    """(cached, new) per row of a step of ``kind``."""
    fresh = (0, rnd.randrange(2, 4 * block_size + 5))
    later = (rnd.choice([block_size, rnd.randrange(1, 5 * block_size)]), rnd.randrange(2, 3 * block_size))
    decodes = [(rnd.randrange(0, 7 * block_size), 1) for _ in range(rnd.randrange(1, 8))]
    if kind == "fresh":
        return [fresh]
    if kind == "chunked":
        return [later]
    if kind == "chunk_with_decodes":  # the chunk anywhere among the decode rows, some longer than it
        decodes.insert(rnd.randrange(len(decodes) + 1), rnd.choice([fresh, later]))
        return decodes
    return decodes + [fresh, later]


@pytest.fixture
def no_host_reads(monkeypatch):
    """Fail on any host read of a tensor value or tensor made from host data (as in forward)."""
    def fail(*args, **kwargs):
        raise AssertionError("read a tensor on the host or copied host data")

    def guard():
        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, fail)
        for name in HOST_DATA:
            monkeypatch.setattr(torch, name, fail)
    return guard


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_mixed_path_equals_reference(kind, group, block_size, seed, monkeypatch, no_host_reads):
    rnd = random.Random(seed * 100 + block_size)
    case = make_case(_rows(kind, rnd, block_size), num_heads=2 * group, num_kv_heads=2, head_dim=32,
                     block_size=block_size, seed=seed, unused=1e4)
    assert not case.meta.is_decode_only
    ref_out, cache = case.reference()
    calls = []
    monkeypatch.setattr(attention_torch, "paged_attention", lambda *a: calls.append(a))  # never the reference
    no_host_reads()
    # k / v None: the KV is read from the cache only
    outs = [attention_torch.mixed_attention(case.q, k, v, cache, case.meta, case.scale)
            for k, v in ((case.k, case.v), (None, None))]
    monkeypatch.undo()
    assert not calls
    for out in outs:
        assert out.shape == case.q.shape and out.dtype == case.q.dtype
        torch.testing.assert_close(out, ref_out, **FP32_TOL)


@pytest.mark.parametrize("rows", [[(0, 37)], [(3, 1), (0, 37), (20, 1)]], ids=["alone", "beside_decodes"])
def test_fresh_prompt_reads_this_steps_kv_not_the_cache(rows):
    """A fresh prompt no other row outgrows attends over the step's own k / v: NaN in its cache
    slots gives the same output (in the engine the step's KV is written first: the same keys)."""
    case = make_case(rows, num_heads=6, num_kv_heads=2, head_dim=16, block_size=8, seed=1)
    ref_out, cache = case.reference()
    fresh_row = [n for _, n in rows].index(37)
    cache.view(2, -1, 2, 16)[:, case.meta.slot_mapping[case.meta.token_to_row == fresh_row]] = float("nan")
    out = attention_torch.mixed_attention(case.q, case.k, case.v, cache, case.meta, case.scale)
    torch.testing.assert_close(out, ref_out, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [[(0, 9)], [(5, 1), (13, 6), (2, 1)]])
def test_mixed_path_low_precision_computes_in_float32(dtype, rows):
    case = make_case(rows, num_heads=6, num_kv_heads=2, head_dim=64, block_size=4, dtype=dtype, seed=3, unused=0.0)
    ref_out, cache = case.reference()
    out = attention_torch.mixed_attention(case.q, case.k, case.v, cache, case.meta, case.scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)
