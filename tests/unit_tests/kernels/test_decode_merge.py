"""The decode kernel's in-kernel merge of its splits (triton_decode_merge) against the merge as a
second launch (``merge_in_kernel=False``): the same bits, splits left empty by short rows
included; and the arrival counters it keeps in ``meta.scratch`` are zero after every call, so the
step's next layer finds them ready."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import kv_cache_fp8 as kf, triton_decode_attention  # noqa: E402
from megatron_async.kernels.triton_decode_attention import decode_attention  # noqa: E402
from megatron_async.kernels.triton_decode_merge import ARRIVALS_KEY  # noqa: E402
from megatron_async.kernels.triton_kv_append import append_kv  # noqa: E402

from tests.helpers.paged_attention_cases import make_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# KV lengths 1-41 in a table of 64 keys: with 8 splits of 16-key tiles the short rows leave most empty
DECODE_ROWS = [(0, 1), (3, 1), (16, 1), (40, 1), (23, 1)]


def _case(group: int, head_dim: int = 16, dtype=torch.float32, seed: int = 0):
    return make_case(DECODE_ROWS, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=4,
                     dtype=dtype, device=DEVICE, table_width=16, seed=seed)


def _counters_zero(meta) -> bool:
    counters = meta.scratch[ARRIVALS_KEY]
    return counters.numel() >= meta.num_rows * 2 and not counters.any()


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_fused_merge_equals_the_merge_launch(num_splits, dtype, group, monkeypatch):
    case = _case(group, dtype=dtype, seed=num_splits + group)
    ref_out, _ = case.reference()
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    two = decode_attention(case.q, case.kv_cache, case.meta, case.scale, num_splits=num_splits,
                           merge_in_kernel=False)
    monkeypatch.setattr(triton_decode_attention, "merge_splits", None)  # the default launches no merge
    fused = decode_attention(case.q, case.kv_cache, case.meta, case.scale, num_splits=num_splits)
    assert torch.equal(fused, two)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused.float(), ref_out.float(), **tol)
    assert _counters_zero(case.meta)


def test_counters_are_zero_for_the_next_layer_and_grow_when_short():
    """Two layers of one step share the metadata (and its counters); a shorter counter tensor left
    by an earlier call is replaced by one long enough, and the padding row (kv_len 0) merges to 0."""
    case = _case(group=2, seed=3)
    case.meta.kv_lens[0] = 0
    case.meta.slot_mapping[0] = -1
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    case.meta.scratch[ARRIVALS_KEY] = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    other_q = torch.randn(case.q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for q in (case.q, other_q):
        out = decode_attention(q, case.kv_cache, case.meta, case.scale, num_splits=4)
        assert _counters_zero(case.meta)
        assert torch.equal(out, decode_attention(q, case.kv_cache, case.meta, case.scale, num_splits=4,
                                                 merge_in_kernel=False))
        assert not out[0].any()
    assert case.meta.scratch[ARRIVALS_KEY].numel() == case.meta.num_rows * 2


@pytest.mark.parametrize("quantize,e4m3,q_dtype", [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                                   (True, True, torch.bfloat16), (False, True, torch.float32)])
def test_quantized_output_and_e4m3_pool_merge_in_kernel(quantize, e4m3, q_dtype):
    """The FP8 o projection's rows (QUANT_OUT) and an e4m3 pool (int16 pairs for 16-bit queries, fp32
    dots for fp32 ones): the fused merge gives the merge launch's bits."""
    case = _case(group=2, head_dim=128, dtype=torch.bfloat16, seed=5)
    pool, scales = case.kv_cache, None
    if e4m3:
        scales = torch.tensor([[1.0, 0.5], [0.25, 1.0]], device=DEVICE)
        pool = torch.nan_to_num(case.kv_cache.float(), nan=0.0).to(kf.FP8_KV)
    append_kv(pool, case.k, case.v, case.meta.slot_mapping, scales)
    q = case.q.to(q_dtype)

    def run(merge_in_kernel: bool):
        return decode_attention(q, pool, case.meta, case.scale, num_splits=3, kv_scale=scales, quantize=quantize,
                                merge_in_kernel=merge_in_kernel)

    fused, two = run(True), run(False)
    if quantize:
        m = fused.m
        assert torch.equal(fused.q[:m].view(torch.uint8), two.q[:m].view(torch.uint8))
        assert torch.equal(fused.scale[:m], two.scale[:m])
    else:
        assert torch.equal(fused, two)
    assert _counters_zero(case.meta)
