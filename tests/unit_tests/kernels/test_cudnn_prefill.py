"""Fresh prompt rows given to cuDNN's attention (kernels/cudnn_prefill.py) beside the Triton kernels
(the interpreter on CPU, where torch's math backend stands in for cuDNN): the host's rule picks
exactly the rows without a cached prefix and with enough tokens, the Triton tile schedule gives
those rows no tile, and the step's output equals the torch reference for every row, with rows of
lengths off the padding bucket, decode rows and chunks after a cached prefix beside them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import attention_triton, cudnn_prefill  # noqa: E402
from megatron_async.kernels.triton_tile_schedule import tile_schedule  # noqa: E402

from tests.helpers.paged_attention_cases import make_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIN_QUERY = 8
"""The threshold the tests lower the engine's to (their rows are 1-37 tokens)."""
# fresh rows of 8+ tokens (0, 37), (0, 8); too short (0, 7); after a cached prefix (9, 12); decode rows
ROWS = [(0, 37), (5, 1), (0, 7), (9, 12), (0, 8), (40, 1), (0, 1)]


def test_the_rule_picks_rows_without_a_prefix_and_of_enough_tokens():
    cu = [0, 37, 38, 45, 57, 65, 66, 67]
    kv_lens = [37, 6, 7, 21, 8, 41, 1]
    assert cudnn_prefill.fresh_rows(cu, kv_lens, MIN_QUERY) == ((0, 37), (57, 8))
    assert cudnn_prefill.fresh_rows(cu, kv_lens, 38) == ()


def _meta(case):
    cu = case.meta.cu_query_lens.tolist()
    fresh = cudnn_prefill.fresh_rows(cu, case.meta.kv_lens.tolist(), MIN_QUERY)
    return dataclasses.replace(case.meta, fresh_rows=fresh, fresh_min_query=MIN_QUERY), fresh


@pytest.mark.parametrize("group,block_size", [(1, 4), (2, 16), (4, 8)])
def test_fresh_rows_and_the_rest_equal_the_reference(group, block_size):
    case = make_case(ROWS, num_heads=2 * group, num_kv_heads=2, head_dim=16, block_size=block_size,
                     device=DEVICE, seed=group + block_size)
    meta, fresh = _meta(case)
    assert fresh == ((0, 37), (57, 8))
    ref, _ = case.reference()
    out = attention_triton.attend(case.q, case.k, case.v, case.kv_cache, meta, case.scale)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_the_tile_schedule_gives_fresh_rows_no_tile():
    case = make_case(ROWS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, device=DEVICE, seed=3)
    meta, fresh = _meta(case)
    slots = case.meta.num_tokens // 4 + case.meta.num_rows
    rows_of = (lambda s: {int(e) >> 32 for e in s.tolist() if e >= 0})
    assert rows_of(tile_schedule(case.meta, 4, slots)) == set(range(len(ROWS)))
    assert rows_of(tile_schedule(meta, 4, slots)) == set(range(len(ROWS))) - {0, 4}


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 8), (32, 8)])
def test_cudnn_rows_at_real_shapes_are_as_close_to_the_reference_as_the_triton_kernel(heads):
    """bf16, head dim 128, 16-token pages, the engine's threshold: fresh rows of 2,048-4,100 tokens
    on cuDNN beside a short fresh row, a chunk after a cached prefix and decode rows on Triton."""
    rows = [(0, 3000), (0, 2048), (100, 1), (500, 700), (0, 4100), (0, 100), (1000, 1), (2047, 1)]
    case = make_case(rows, num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, block_size=16,
                     dtype=torch.bfloat16, device="cuda", seed=7)
    fresh = cudnn_prefill.fresh_rows(case.meta.cu_query_lens.tolist(), case.meta.kv_lens.tolist(),
                                     cudnn_prefill.FRESH_MIN_QUERY)
    assert fresh == ((0, 3000), (3000, 2048), (5749, 4100))
    meta = dataclasses.replace(case.meta, fresh_rows=fresh, fresh_min_query=cudnn_prefill.FRESH_MIN_QUERY)
    ref = case.reference()[0].float()
    out = attention_triton.attend(case.q, case.k, case.v, case.kv_cache.clone(), meta, case.scale).float()
    triton_only = attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale).float()
    err, triton_err = (out - ref).abs().max().item(), (triton_only - ref).abs().max().item()
    assert err <= max(2 * triton_err, 1e-2), (err, triton_err)
    rest = torch.ones(case.q.shape[0], dtype=torch.bool, device="cuda")
    for start, length in fresh:
        rest[start: start + length] = False
    assert torch.equal(out[rest], triton_only[rest])  # the other rows: the Triton kernel's own bits
