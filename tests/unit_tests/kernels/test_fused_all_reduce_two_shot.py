"""The fused all-reduce + add + RMSNorm's two-shot kernel, one process playing one rank (as
test_fused_all_reduce.py plays the one-shot one): the peers' pushes are placed in this rank's
buffer beforehand (their rows of this rank's chunk in their slots, and the new residual rows of
their own chunks in their slots) and both barriers' flags raised; the launch must give the
reference sum and norm, push its rows to their owners and its own chunk's new residual rows to
every rank, and raise its flags in both regions of every pad."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import triton_fused_all_reduce as fused  # noqa: E402
from tests.unit_tests.kernels.test_fused_all_reduce import DEVICE, EPS, _case, _check, _reference  # noqa: E402


def _play_two_shot(parts, rank, residual, norm, max_programs, calls_before=0):
    """Run the two-shot kernel as ``rank``; returns (out, new residual, buffers, pads, used half)."""
    W, (M, N) = len(parts), parts[0].shape
    chunk = -(-M // W)
    want_res = _reference(parts, residual, norm)[1]
    half = W * M * N + 64
    buffers = [torch.zeros(2 * half, dtype=parts[0].dtype, device=DEVICE) for _ in range(W)]
    pads = [torch.zeros(2 * max_programs * W, dtype=torch.int32, device=DEVICE) for _ in range(W)]
    used = (calls_before & 1) * half
    slot = lambda r, rows: slice(used + r * M * N + rows.start * N, used + r * M * N + rows.stop * N)  # noqa: E731
    own = range(min(rank * chunk, M), min((rank + 1) * chunk, M))
    for r in range(W):
        if r != rank:  # peer r's rows of this rank's chunk (phase 1), its own chunk's new residual (phase 2)
            buffers[rank][slot(r, own)] = parts[r][own.start:own.stop].flatten()
            theirs = range(min(r * chunk, M), min((r + 1) * chunk, M))
            buffers[rank][slot(r, theirs)] = want_res[theirs.start:theirs.stop].flatten()
    programs = min(M, max_programs)
    after = calls_before + 1
    flags = pads[rank].view(2, max_programs, W)
    flags[:, :programs, :] = after  # both barriers' flags from every peer
    state = torch.tensor([calls_before, 0], dtype=torch.int32, device=DEVICE)
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)  # noqa: E731
    out, new_res = fused.all_reduce_add_rms_norm(parts[rank], residual, norm.weight, EPS, norm.cast_before_weight,
                                                 table(buffers), table(pads), state, half * parts[0].element_size(),
                                                 rank, max_programs, two_shot=True)
    assert state.tolist() == [after, 0]
    for r in range(W):  # its own rows: to their owners, in slot `rank`
        rows = range(min(r * chunk, M), min((r + 1) * chunk, M))
        if r != rank:
            assert torch.equal(buffers[r][slot(rank, rows)], parts[rank][rows.start:rows.stop].flatten())
        if r != rank:  # both barriers' flags raised in every peer's pad
            assert bool((pads[r].view(2, max_programs, W)[:, :programs, rank] == after).all())
    return out, new_res, buffers, slot, own, want_res


@pytest.fixture(autouse=True)
def _two_shot_at_every_size(monkeypatch):
    monkeypatch.setattr(fused, "TWO_SHOT_MIN_BYTES", 0)  # the interpreter's shapes are small


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world,rows,max_programs", [(4, 8, 3), (4, 6, 8), (8, 9, 4)])
def test_two_shot_gives_every_rank_the_reference_and_the_one_shot_bits(dtype, world, rows, max_programs):
    # 6 rows at 4 ranks: chunks of 2, the last rank owns none; 9 at 8: one row each, 1 over
    parts, residual, norm = _case(world, rows, 64, dtype, seed=world + rows)
    want_out, want_res = _reference(parts, residual, norm)
    for rank in range(world):
        out, new_res, buffers, slot, own, _ = _play_two_shot(parts, rank, residual, norm, max_programs,
                                                             calls_before=rank)
        assert torch.equal(new_res, want_res)  # one rounding of the rank-order sum, one of + residual
        _check(out, want_out)
        for b in buffers:  # its chunk's new residual rows pushed into slot `rank` of every rank
            assert torch.equal(b[slot(rank, own)], want_res[own.start:own.stop].flatten())


def test_two_shot_is_taken_for_whole_rows_at_four_ranks_and_more(monkeypatch):
    monkeypatch.setattr(fused, "TWO_SHOT_MIN_BYTES", 512 << 10)
    big, small = torch.zeros(128, 4096, dtype=torch.bfloat16), torch.zeros(32, 4096, dtype=torch.bfloat16)
    assert fused.takes_two_shot(big, big, 4) and fused.takes_two_shot(big, big, 8)
    assert not fused.takes_two_shot(big, big, 2)  # one message either way
    assert not fused.takes_two_shot(small, small, 4)  # 256 KB: one-shot's one barrier is cheaper
    assert not fused.takes_two_shot(torch.zeros(4, 128, 4096), big, 4)  # K-split partials stay one-shot
