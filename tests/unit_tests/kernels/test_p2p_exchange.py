"""The EP exchange's P2P all-gather and reduce-scatter kernels, one process playing one rank:
the other ranks' data sits in their "symmetric buffers" (same-process tensors whose addresses
fill the pointer table) as if their copy-in had run, and the barriers are skipped. Checks the
copy-in (what the peers would read), the gathered rows in rank order and the float32 rank-order
sum of this rank's slice, on grids smaller than the data (programs looping). The flag protocol
is the fused all-reduce's (test_fused_all_reduce.py); the real ranks run in the multigpu suite.
Compiled on CUDA, the interpreter on CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import triton_p2p_exchange as ex  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _table(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)


def _ranks(world, rank, rows, width, dtype, seed):
    """Every rank's input, the peers' buffers already holding theirs, zeroed signal pads."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(rows, width, generator=g).to(DEVICE, dtype) for _ in range(world)]
    buffers = [torch.zeros(rows * width + 64, dtype=dtype, device=DEVICE) for _ in range(world)]
    for r in range(world):
        if r != rank:
            buffers[r][: rows * width].copy_(parts[r].flatten())
    pads = [torch.zeros(8 * world, dtype=torch.int32, device=DEVICE) for _ in range(world)]
    return parts, buffers, _table(buffers), _table(pads)


@pytest.mark.parametrize("world, rank, rows, width", [(2, 1, 5, 6), (4, 2, 3, 1030), (4, 0, 1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_gather_plays_one_rank(world, rank, rows, width, dtype):
    parts, buffers, buf_table, pad_table = _ranks(world, rank, rows, width, dtype, seed=world * 7 + rows)
    out = ex.all_gather(parts[rank], buf_table, pad_table, rank, max_programs=2, barrier=False)
    assert torch.equal(buffers[rank][: rows * width], parts[rank].flatten())  # its copy-in, for the peers
    assert torch.equal(out, torch.cat(parts))


@pytest.mark.parametrize("world, rank, rows, width", [(2, 0, 4, 6), (4, 3, 8, 700), (2, 1, 2, 2050)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_scatter_plays_one_rank(world, rank, rows, width, dtype):
    parts, buffers, buf_table, pad_table = _ranks(world, rank, rows, width, dtype, seed=world * 11 + rows)
    out = ex.reduce_scatter(parts[rank], buf_table, pad_table, rank, max_programs=2, barrier=False)
    n = rows // world
    total = parts[0][rank * n:(rank + 1) * n].float()
    for p in parts[1:]:
        total = total + p[rank * n:(rank + 1) * n].float()
    assert torch.equal(buffers[rank][: rows * width], parts[rank].flatten())
    if dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter's float32 -> bf16 truncates
        torch.testing.assert_close(out.float(), total, rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(out, total.to(dtype))
