"""The prefill attention's long-row launch (``HOPPER_LONG``, picked by ``AttentionMetadata.long_tiles``)
computes what the default launch computes: random fp32 steps with prefix-cached context, GQA groups,
rows of varied lengths (some longer than a long tile) and decode rows beside them (interpreter on
CPU, compiled on CUDA)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import triton_prefill_attention  # noqa: E402
from megatron_async.kernels.triton_kv_append import append_kv  # noqa: E402
from megatron_async.kernels.triton_prefill_common import HOPPER_LONG, prefill_launch  # noqa: E402

from tests.helpers.paged_attention_cases import make_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


def _random_rows(seed: int) -> list[tuple[int, int]]:
    """(cached, new) tokens a row: one chunk longer than a 128-row tile after a cached prefix, a
    fresh prompt, shorter chunks and decode rows, all lengths drawn at random."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    return [(r(1, 90), r(130, 170)), (0, r(65, 100)), (r(0, 40), r(2, 20)), (r(1, 60), 1), (r(0, 30), 1)]


@pytest.mark.parametrize("group, block_size, seed", [(2, 16, 0), (4, 8, 1), (1, 16, 2)])
def test_long_launch_equals_the_default_launch(group, block_size, seed, monkeypatch):
    case = make_case(_random_rows(seed), num_heads=2 * group, num_kv_heads=2, head_dim=32, block_size=block_size,
                     device=DEVICE, seed=seed)
    ref, cache = case.reference()
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    chosen = []
    real = triton_prefill_attention.fitted_launch
    monkeypatch.setattr(triton_prefill_attention, "fitted_launch",
                        lambda launch, *a: chosen.append(launch) or real(launch, *a))
    default = triton_prefill_attention.prefill_attention(case.q, case.kv_cache, case.meta, case.scale)
    long_meta = dataclasses.replace(case.meta, long_tiles=True)
    long = triton_prefill_attention.prefill_attention(case.q, case.kv_cache, long_meta, case.scale)
    assert chosen == [prefill_launch(group, 32, block_size, torch.device(DEVICE)), HOPPER_LONG]
    assert chosen[0].rows < HOPPER_LONG.rows and chosen[0].block_n < HOPPER_LONG.block_n  # two tilings
    torch.testing.assert_close(long, default, **FP32_TOL)
    torch.testing.assert_close(long, ref, **FP32_TOL)


def test_long_tiles_hold_head_dims_up_to_128():
    """``HOPPER_LONG``'s 128-register cap and the invariant kernel's 128-row tiles (128 registers)
    cannot hold a 256-wide accumulator (ptxas refuses it on sm_90): wider heads keep the default
    launch, and the invariant kernel one launch of its small tiles."""
    from megatron_async.kernels.triton_invariant_attention import launches

    cuda = torch.device("cuda")
    assert prefill_launch(2, 128, 16, cuda, long=True) == HOPPER_LONG
    assert prefill_launch(2, 64, 16, cuda, long=True) == HOPPER_LONG
    assert prefill_launch(2, 256, 16, cuda, long=True) == prefill_launch(2, 256, 16, cuda)
    case = make_case([(0, 300), (40, 1)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    meta = dataclasses.replace(case.meta, long_tiles=True)
    assert [len(launches(meta, 2, 64, d, cuda)) for d in (64, 128, 256)] == [2, 2, 1]
