"""The torch backend's lean decode path (``attention_torch.decode_attention``) against the
general reference (``paged_attention``) on fresh random paged problems, and the dispatch that
picks it for decode-only steps."""
from __future__ import annotations

import random

import pytest
import torch

from megatron_async.config import AttentionBackend
from megatron_async.kernels import attention, attention_torch

from tests.helpers.paged_attention_cases import make_case  # noqa: E402

FP32_TOL = dict(rtol=1e-5, atol=1e-6)


def _decode_case(seed: int, group: int, head_dim: int, block_size: int, dtype=torch.float32, unused=1e4, **kw):
    """Random decode rows: cached lengths from 0 (kv_len 1) to several blocks, on and across block
    boundaries. Unused cache slots hold ``unused`` (large), so a key read past a row's length shows."""
    rnd = random.Random(seed)
    rows = [(rnd.choice([0, block_size - 1, block_size, rnd.randrange(0, 5 * block_size + 3)]), 1)
            for _ in range(rnd.randrange(1, 10))]
    return make_case(rows, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, seed=seed, unused=unused, **kw)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_decode_path_equals_reference(group, block_size, seed):
    case = _decode_case(seed, group, head_dim=32, block_size=block_size, table_width=None if seed % 2 else 24)
    assert case.meta.is_decode_only
    ref_out, cache = case.reference()
    out = attention_torch.decode_attention(case.q, cache, case.meta, case.scale)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out, ref_out, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_path_low_precision_computes_in_float32(dtype):
    case = _decode_case(7, group=2, head_dim=64, block_size=8, dtype=dtype, unused=0.0)
    ref_out, cache = case.reference()
    out = attention_torch.decode_attention(case.q, cache, case.meta, case.scale)
    assert out.dtype == dtype
    # both compute in float32 and round once: at most one unit in the last place apart
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)


def test_attend_dispatches_decode_steps_to_the_lean_path(monkeypatch):
    """Torch backend: decode-only steps take decode_attention, other steps mixed_attention."""
    calls = []
    for name in ("decode_attention", "mixed_attention"):
        real = getattr(attention_torch, name)
        monkeypatch.setattr(attention_torch, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    decode = _decode_case(3, group=3, head_dim=16, block_size=4, unused=0.0)
    ref_out, ref_cache = decode.reference()
    calls.clear()
    out = attention.attend(decode.q, decode.k, decode.v, decode.kv_cache.nan_to_num(0.0), decode.meta, decode.scale,
                           backend=AttentionBackend.TORCH)
    assert calls == ["decode_attention"]
    torch.testing.assert_close(out, ref_out, **FP32_TOL)
    mixed = make_case([(0, 5), (3, 1), (9, 2)], num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, unused=0.0)
    assert not mixed.meta.is_decode_only
    calls.clear()
    attention.attend(mixed.q, mixed.k, mixed.v, mixed.kv_cache, mixed.meta, mixed.scale, backend=AttentionBackend.TORCH)
    assert calls == ["mixed_attention"]
