"""The fused TP all-reduce + residual add + RMSNorm kernel, one process playing one rank.

The other ranks' partials are placed in their slots of this rank's "symmetric buffer" (same-
process tensors whose addresses fill the pointer table) before the launch, as if their pushes
had run, and their
barrier flags in this rank's signal pad are raised beforehand (to the call's epoch + 1): the
kernel's own raises then go into the peers' pads and its waits find the peers' flags. So one
launch checks the arithmetic (against sum in rank order + add + RMSNorm), the flag protocol
(epoch + 1 stored in this rank's slot of every pad, once per program) and the call counter
whose parity picks the buffer half.
Compiled on CUDA, the interpreter on CPU (whose float32 -> bfloat16 conversion truncates: bf16
to tolerance there; float16 and float32 are checked exactly)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import triton_fused_all_reduce as fused  # noqa: E402
from megatron_async.models.layers.norm import NemotronRMSNorm, RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _reference(parts: list[torch.Tensor], residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path: the all-reduce (float32, rank order, one rounding), then add + norm (torch code)."""
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    reduced = total.to(parts[0].dtype)
    new_residual = reduced + residual
    return norm(new_residual), new_residual


def _play_rank(parts: list[torch.Tensor], rank: int, residual: torch.Tensor, norm: RMSNorm, max_programs: int,
               barrier: bool = True, calls_before: int = 0, peer_lead: int = 0,
               own: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Run the kernel as ``rank`` after ``calls_before`` calls (the counter's parity picks the
    half of every buffer the call uses), the peers' flags ``peer_lead`` calls ahead; returns
    (out, new residual, every rank's signal pad after). ``own``: what the rank hands the kernel
    instead of ``parts[rank]`` (its float32 K-split partials, which sum to ``parts[rank]``)."""
    W = len(parts)
    M, N = parts[0].shape
    half = W * M * N + 64  # elements; in bytes a 16-byte multiple for every dtype here
    buffers = [torch.zeros(2 * half, dtype=parts[0].dtype, device=DEVICE) for _ in range(W)]
    pads = [torch.zeros(max_programs * W, dtype=torch.int32, device=DEVICE) for _ in range(W)]
    used = (calls_before & 1) * half
    for r in range(W):
        if r != rank:  # the peers' pushes into this rank's buffer
            buffers[rank][used + r * M * N: used + (r + 1) * M * N].copy_(parts[r].flatten())
    programs = min(M, max_programs)
    after = (calls_before + 1 + 2**31) % 2**32 - 2**31  # epoch + 1 in int32 arithmetic
    flags = pads[rank].view(max_programs, W)
    flags[:programs, :] = after + peer_lead  # the peers' raises (this rank's own lane too: the kernel rewrites it)
    state = torch.tensor([calls_before, 0], dtype=torch.int32, device=DEVICE)
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)  # noqa: E731
    out, new_res = fused.all_reduce_add_rms_norm(parts[rank] if own is None else own, residual, norm.weight, EPS, norm.cast_before_weight,
                                                 table(buffers), table(pads), state, half * parts[0].element_size(),
                                                 rank, max_programs, barrier)
    for b in buffers:  # its push: slot `rank` of every buffer's half, its own included; the other half untouched
        assert torch.equal(b[used + rank * M * N: used + (rank + 1) * M * N], parts[rank].flatten())
        other = half - used
        assert not b[other: other + half].any()
    assert state.tolist() == [after, 0]  # the call counted, arrivals back to 0
    return out, new_res, pads


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16 and DEVICE == "cpu":  # interpreter truncation
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    elif got.dtype == torch.float32:  # the norm's float32 reduction order may differ from torch's
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert (got != want).float().mean() < 0.01  # a rare last-ulp flip of the float32 sum order
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


def _case(world: int, rows: int, hidden: int, dtype: torch.dtype, seed: int, norm_cls=RMSNorm):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE) for _ in range(world)]
    residual = (3 * torch.randn(rows, hidden, generator=g)).to(dtype).to(DEVICE)
    norm = norm_cls(hidden, EPS, dtype, DEVICE)
    norm.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=g))
    return parts, residual, norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world,rows,max_programs", [(1, 3, 4), (2, 5, 2), (4, 7, 3), (8, 2, 4)])
def test_every_rank_gets_the_reference_sum_and_norm(dtype, world, rows, max_programs):
    parts, residual, norm = _case(world, rows, 64, dtype, seed=world * 10 + rows)
    want_out, want_res = _reference(parts, residual, norm)
    results = []
    for rank in range(world):
        out, new_res, pads = _play_rank(parts, rank, residual, norm, max_programs)
        if dtype == torch.bfloat16 and DEVICE == "cpu":
            _check(new_res, want_res)
        else:
            assert torch.equal(new_res, want_res)  # the sum rounded once, then one rounding of + residual
        _check(out, want_out)
        results.append((out, new_res))
        # Flags: each peer's pad got epoch + 1 = 1 in this rank's lane of every program's slot.
        programs = min(rows, max_programs)
        for r in range(world):
            if r != rank:
                raised = torch.zeros(max_programs, world, dtype=torch.int32, device=DEVICE)
                raised[:programs, rank] = 1
                assert torch.equal(pads[r].view(max_programs, world), raised)
    for out, new_res in results[1:]:  # rank order: every rank holds the same bits
        assert torch.equal(out, results[0][0]) and torch.equal(new_res, results[0][1])


@pytest.mark.parametrize("calls_before", [1, 6, 2**31 - 1, -2**31])
def test_the_call_counter_alternates_the_buffer_halves(calls_before):
    """An odd count uses the second half, an even one the first, also where the int32 counter
    wraps (2**31 - 1 calls, then -2**31)."""
    parts, residual, norm = _case(2, 5, 64, torch.float32, seed=11)
    want_out, want_res = _reference(parts, residual, norm)
    out, new_res, _ = _play_rank(parts, 1, residual, norm, max_programs=3, calls_before=calls_before)
    assert torch.equal(new_res, want_res)
    _check(out, want_out)


def test_a_peer_one_call_ahead_releases_the_barrier():
    """A peer already in the next call has stored epoch + 2 over its epoch + 1: still released."""
    parts, residual, norm = _case(2, 4, 64, torch.float32, seed=13)
    want_out, want_res = _reference(parts, residual, norm)
    out, new_res, _ = _play_rank(parts, 0, residual, norm, max_programs=4, calls_before=5, peer_lead=1)
    assert torch.equal(new_res, want_res)
    _check(out, want_out)


def test_float32_matches_the_unfused_layers_within_1e6():
    """Against the layers' unfused path itself: sum, then ``RMSNorm.add_and_norm`` (torch code on CPU)."""
    parts, residual, norm = _case(4, 6, 96, torch.float32, seed=7)
    total = parts[0] + parts[1] + parts[2] + parts[3]
    want_out, want_res = norm.add_and_norm(total, residual)
    out, new_res, _ = _play_rank(parts, 1, residual, norm, max_programs=8)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(new_res, want_res) < 1e-6 and rel(out, want_out) < 1e-6


def test_nemotron_norm_scales_before_casting():
    parts, residual, norm = _case(2, 4, 64, torch.float16, seed=3, norm_cls=NemotronRMSNorm)
    want_out, want_res = _reference(parts, residual, norm)
    out, new_res, _ = _play_rank(parts, 0, residual, norm, max_programs=4)
    assert torch.equal(new_res, want_res)
    _check(out, want_out)


def test_without_barrier_the_flags_stay_untouched():
    parts, residual, norm = _case(2, 3, 32, torch.float32, seed=5)
    want_out, want_res = _reference(parts, residual, norm)
    out, new_res, pads = _play_rank(parts, 1, residual, norm, max_programs=4, barrier=False)
    assert torch.equal(new_res, want_res)
    _check(out, want_out)
    assert not pads[0].any()  # no flag raised in the peer's pad


@pytest.mark.parametrize("splits", [1, 4])
def test_k_split_partials_are_summed_in_split_order_before_the_exchange(splits):
    """A rank hands float32 [splits, rows, hidden] partials (a row-parallel projection's K splits):
    it pushes their sum in split order, rounded to the activation dtype, and the result is the
    unsplit path's on that rounded sum."""
    dtypes = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])  # (the interpreter truncates bf16)
    for dtype in dtypes:
        parts, residual, norm = _case(4, 3, 64, dtype, seed=21 + splits)
        pieces = torch.randn(splits, 3, 64, generator=torch.Generator().manual_seed(splits)).to(DEVICE)
        total = pieces[0].clone()
        for piece in pieces[1:]:
            total += piece
        parts[2] = total.to(dtype)
        want_out, want_res = _reference(parts, residual, norm)
        out, new_res, _ = _play_rank(parts, 2, residual, norm, max_programs=2, own=pieces)
        assert torch.equal(new_res, want_res)
        _check(out, want_out)


def test_supported_shapes():
    x = torch.zeros(4, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    assert fused.supported(x, x.clone(), w, 4)
    assert not fused.supported(x, x.clone(), w, 3)  # world not a power of two
    assert not fused.supported(x, x.double(), w, 2)  # float32 residual stream under other activations
    assert not fused.supported(x[:, :60], x[:, :60].clone(), w[:60], 2)  # rows not 16-byte multiples
    assert not fused.supported(x.t(), x.t().clone(), torch.ones(4, device=DEVICE), 2)  # not contiguous
    assert not fused.supported(x.view(2, 2, 64), x.view(2, 2, 64).clone(), w, 2)  # 2-d rows only, or
    half = x.half()  # float32 K-split partials of half-precision rows
    assert fused.supported(x.view(2, 2, 64), half[:2].clone(), w.half(), 2)
    assert not fused.supported(x.view(2, 2, 64).half(), half[:2].clone(), w.half(), 2)
    with pytest.raises(ValueError, match="all_reduce_add_rms_norm"):
        table = torch.zeros(3, dtype=torch.int64, device=DEVICE)
        fused.all_reduce_add_rms_norm(x, x, w, EPS, True, table, table, torch.zeros(2, dtype=torch.int32), 4096, 0, 4)
    with pytest.raises(ValueError, match="do not fit a buffer half"):
        table = torch.zeros(2, dtype=torch.int64, device=DEVICE)
        fused.all_reduce_add_rms_norm(x, x, w, EPS, True, table, table, torch.zeros(2, dtype=torch.int32), 2032, 0, 4)
