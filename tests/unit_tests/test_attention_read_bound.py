"""The decode attention's read bound (``kernel-times attention-read-bound``): its access
pattern read alone sums exactly the row's keys and values of each KV head, and the decode
kernel reads the heads-major view of a cache to the same bits (interpreted on CPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.kernel_times.attention_read_bound import heads_major, read_pattern  # noqa: E402
from megatron_async.kernels import attention_triton  # noqa: E402
from megatron_async.kernels.triton_decode_attention import decode_attention  # noqa: E402
from tests.helpers.paged_attention_cases import make_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block_size", [16, 32])
def test_pattern_reads_each_rows_keys_and_values_once(block_size):
    lens = [40, 17, 5]
    case = make_case([(n - 1, 1) for n in lens], block_size=block_size, num_heads=4, num_kv_heads=2, head_dim=16,
                     device=DEVICE, seed=1)
    attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)
    table, cache = case.meta.block_table.long().cpu(), case.kv_cache.cpu()
    want = torch.zeros(len(lens), 2, dtype=torch.float64)
    for r, n in enumerate(lens):
        slots = table[r, torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        kv = cache.flatten(1, 2)[:, slots]  # [2, n, KV heads, head_dim]
        want[r] = kv.double().sum(dim=(0, 1, 3))
    for layout in (case.kv_cache, heads_major(case.kv_cache)):
        got = read_pattern(layout, case, block_n=16).double().cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_decode_kernel_reads_the_heads_major_view_to_the_same_bits():
    case = make_case([(n - 1, 1) for n in (33, 8, 64)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=16,
                     device=DEVICE, seed=2)
    attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale)
    view = heads_major(case.kv_cache)
    assert view.stride(3) == 16 * 16 and view.stride(2) == 16  # each block's heads outermost
    base = decode_attention(case.q, case.kv_cache, case.meta, case.scale)
    assert torch.equal(decode_attention(case.q, view, case.meta, case.scale), base)
