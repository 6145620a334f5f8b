"""The Triton sampler kernels compiled on CUDA at Qwen3's 151,936-token vocabulary, against the
torch reference (sampling.py) and torch's argmax. The CPU tests (test_triton_sampling.py) run
the same kernels interpreted at tiny shapes; these prove the compiled launches at the engine's
row counts. Times: ``python -m benchmarks kernel-times sampler-kernels`` / ``small-kernels``."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import triton_sampling  # noqa: E402
from tests.helpers.sampler_cases import (  # noqa: E402
    CASES, KINDS, TUNINGS, case_filters, fast, make_logits, penalty_rows, reference, row_params, step_flags,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 151_936


def _logits(rows: int, seed: int, count: int = 4) -> list[torch.Tensor]:
    """``count`` bf16 [rows, VOCAB] logits; the first with a tie at its top (ids 5 and 7)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = [torch.randn(rows, VOCAB, generator=g, device="cuda").to(torch.bfloat16) for _ in range(count)]
    sets[0][:, 5] = sets[0][:, 7] = sets[0].max() + 1
    return sets


@pytest.mark.parametrize("rows", [1, 64, 128, 256])
def test_argmax_is_torchs_first_largest_index(rows):
    for x in _logits(rows, seed=rows):
        assert torch.equal(triton_sampling.argmax(x), x.argmax(-1))


@pytest.mark.parametrize("chunk, block", [(c, b) for c in (4096, 8192, 16384) for b in (1024, 2048, 4096) if b <= c])
@pytest.mark.parametrize("warps", [4, 8])
def test_argmax_launch_settings_keep_the_answer(chunk, block, warps):
    for x in _logits(128, seed=chunk + block + warps, count=2):
        assert torch.equal(triton_sampling.argmax(x, chunk=chunk, block=block, num_warps=warps), x.argmax(-1))


def _draws_equal_the_reference(R: int, V: int, kind: str, name: str, seed: int, device: str, **launch) -> None:
    """Fresh logits and parameters (odd seeds: every row its own): the Triton sampler draws the
    reference's tokens with every filter stage launched, with the step's own filter flags (as
    the engine launches it: no top-k row, top-p draws first), and from the bf16 logits the
    engine hands it (exact in float32)."""
    gen = torch.Generator(device=device).manual_seed(seed + 7919 * R + 104729 * KINDS.index(kind))
    logits = make_logits(R, V, kind, gen)
    params = row_params(R, CASES[name], gen, mixed=seed % 2 == 1)
    pen = penalty_rows(R, V, gen) if CASES[name][4] else None
    expected = reference(logits, params, pen, True)
    assert torch.equal(fast(logits, params, pen, True, **launch), expected), "all filter stages"
    flags = step_flags(params, V)
    assert torch.equal(fast(logits, params, pen, flags, **launch), expected), f"step flags {flags}"
    assert torch.equal(fast(logits.to(torch.bfloat16), params, pen, True, **launch), expected), "bf16 logits"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [128, 256])
def test_sampler_draws_the_references_tokens(rows, kind, case):
    for seed in range(3):
        _draws_equal_the_reference(rows, VOCAB, kind, case, seed, "cuda")


@pytest.mark.parametrize("tuning", TUNINGS, ids=lambda t: "-".join(map(str, t)))
def test_launch_variants_draw_the_references_tokens(tuning):
    """The fast path's launch variants (chunk, histogram block, pivots, candidate cap, warps) at 128 rows."""
    chunk, hist_block, pivots, cap, warps = tuning
    gen = torch.Generator(device="cuda").manual_seed(2)
    for name in ("temperature", "top_k=50", "top_p=0.95", "k+p+min_p"):
        for kind in ("spread", "flat"):
            logits = make_logits(128, VOCAB, kind, gen)
            params = row_params(128, CASES[name], gen, mixed=False)
            filters = case_filters(CASES[name])
            got = fast(logits, params, None, filters, chunk=chunk, hist_block=hist_block, pivots=pivots, cap=cap,
                       num_warps=warps)
            assert torch.equal(got, reference(logits, params, None, any(filters))), (name, kind)


def test_fast_gumbel_stays_within_its_bound_for_every_uniform():
    """The draw skips the exact noise of elements more than ``near_margin`` below the best fast
    score; that is exact only while every fast value is within G_ERR of the exact one: all 2**24."""
    from megatron_async.kernels import triton_gumbel

    err = triton_gumbel.fast_error()
    assert 0.0 < err <= triton_gumbel.G_ERR.value / 4, err


def test_draws_equal_whichever_way_near_elements_are_scored():
    """Near-best elements scored as a vector (near_loop 0), one by one up to 4 (the default), or
    always one by one: the reference's tokens, tiny temperatures and -inf logits included; rows
    holding +inf or NaN (scored exactly from that block on) draw the same in every way, the
    first +inf where no filter applies, as the reference."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    for name, mixed in (("temperature", False), ("top_p=0.95", False), ("k+p+min_p", False), ("k+p+min_p", True)):
        for kind in KINDS:
            logits = make_logits(128, VOCAB, kind, gen)
            logits[3, 70_000] = float("inf")
            logits[4, 90_000:90_010] = float("inf")
            logits[5, 100] = float("nan")
            logits[6, ::2] = float("-inf")
            params = row_params(128, CASES[name], gen, mixed=mixed)
            filters = True if mixed else case_filters(CASES[name])  # every row its own: every stage
            expected = reference(logits, params, None, any(filters) if not mixed else True)
            draws = [fast(logits, params, None, filters, near_loop=n) for n in (0, 4, 1024)]
            special = (5,) if name == "temperature" else (3, 4, 5)
            plain = [r for r in range(128) if r not in special]
            for got in draws:
                assert torch.equal(got[plain], expected[plain]), (name, mixed, kind)
                assert torch.equal(got, draws[0]), (name, mixed, kind)


def test_near_tied_leaders_drawn_by_their_exact_scores():
    """Rows whose two leaders score within 4 ulps of each other (or tie) exactly: the approximate
    noise (within ~2e-6, about 2 ulps at 10) would order them at random; the near-best scoring
    must give the exact argmax, the first index on ties, in both scoring ways and filter settings."""
    from tests.helpers.sampler_cases import near_tie_case

    logits, params, expected = near_tie_case(128, VOCAB, torch.Generator(device="cuda").manual_seed(6))
    for near_loop in (0, 4):
        for filters in (False, True):
            got = triton_sampling.sample(logits, params.temperature, params.top_k, params.top_p, params.min_p,
                                         params.seed, params.position, filters, near_loop=near_loop)
            assert torch.equal(got, expected), (near_loop, filters)
