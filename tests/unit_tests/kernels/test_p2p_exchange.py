"""The EP exchange's P2P all-gather and reduce-scatter kernels, one process playing one rank:
the other ranks' data sits in their "symmetric buffers" (same-process tensors whose addresses
fill the pointer table) as if their copy-in had run, and the barrier is skipped. Checks the
copy-in (what the peers would read, in the half the call counter's parity picks), the gathered
rows in rank order and the float32 rank-order sum of this rank's slice, on grids smaller than
the data (programs looping). The flag protocol is the fused all-reduce's
(test_fused_all_reduce.py); the real ranks run in the multigpu suite.
Compiled on CUDA, the interpreter on CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import triton_p2p_exchange as ex  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _table(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)


HALF = 5608  # elements per buffer half: every case's input fits, a 16-byte multiple in every dtype


def _ranks(world, rank, rows, width, dtype, seed, calls_before):
    """Every rank's input, the peers' buffers already holding theirs (in the half the call uses),
    zeroed signal pads, the call counter."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(rows, width, generator=g).to(DEVICE, dtype) for _ in range(world)]
    buffers = [torch.zeros(2 * HALF, dtype=dtype, device=DEVICE) for _ in range(world)]
    used = (calls_before % 2) * HALF
    for r in range(world):
        if r != rank:
            buffers[r][used: used + rows * width].copy_(parts[r].flatten())
    pads = [torch.zeros(8 * world, dtype=torch.int32, device=DEVICE) for _ in range(world)]
    state = torch.tensor([calls_before, 0], dtype=torch.int32, device=DEVICE)
    return parts, buffers, _table(buffers), _table(pads), state, used


def _own_copy(buffers, rank, used, x):
    """The call's copy-in sits in its half of this rank's buffer; the other half is untouched."""
    n = x.numel()
    assert torch.equal(buffers[rank][used: used + n], x.flatten())
    other = HALF - used
    assert not buffers[rank][other: other + HALF].any()


@pytest.mark.parametrize("world, rank, rows, width, calls_before", [(2, 1, 5, 6, 0), (4, 2, 3, 1030, 3),
                                                                   (4, 0, 1, 8, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_gather_plays_one_rank(world, rank, rows, width, calls_before, dtype):
    parts, buffers, buf_table, pad_table, state, used = _ranks(world, rank, rows, width, dtype, world * 7 + rows,
                                                               calls_before)
    half_bytes = HALF * parts[0].element_size()
    out = ex.all_gather(parts[rank], buf_table, pad_table, state, half_bytes, rank, max_programs=2, barrier=False)
    _own_copy(buffers, rank, used, parts[rank])
    assert torch.equal(out, torch.cat(parts))
    assert state.tolist() == [calls_before + 1, 0]


@pytest.mark.parametrize("world, rank, rows, width, calls_before", [(2, 0, 4, 6, 1), (4, 3, 8, 700, 0),
                                                                   (2, 1, 2, 2050, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_scatter_plays_one_rank(world, rank, rows, width, calls_before, dtype):
    parts, buffers, buf_table, pad_table, state, used = _ranks(world, rank, rows, width, dtype, world * 11 + rows,
                                                               calls_before)
    half_bytes = HALF * parts[0].element_size()
    out = ex.reduce_scatter(parts[rank], buf_table, pad_table, state, half_bytes, rank, max_programs=2,
                            barrier=False)
    n = rows // world
    total = parts[0][rank * n:(rank + 1) * n].float()
    for p in parts[1:]:
        total = total + p[rank * n:(rank + 1) * n].float()
    _own_copy(buffers, rank, used, parts[rank])
    assert state.tolist() == [calls_before + 1, 0]
    if dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter's float32 -> bf16 truncates
        torch.testing.assert_close(out.float(), total, rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(out, total.to(dtype))
