"""The sort-free Triton sampler and penalty kernel against the torch reference definition
(sampling.py), on fresh random logits: many seeds, top-k / top-p / min-p alone and mixed,
greedy rows, tiny temperatures, heavy ties, -inf entries. Runs in Triton's interpreter on
the CPU (tiny shapes, small blocks so the block loops and searches really iterate)."""
import pytest
import torch

from megatron_async.inference.text_generation_controllers import sampling as ref
from megatron_async.kernels import triton_sampling

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = dict(chunk=64, block=32, search_block=32, pivots=16)  # V > block: several blocks per pass


def _case(R: int, V: int, seed: int, mode: str):
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(R, V, generator=g)
    if mode == "ties":
        logits = torch.round(logits * 2) / 2
    if mode == "neg_inf":
        logits[torch.rand(R, V, generator=g) < 0.3] = float("-inf")
    temp = torch.rand(R, generator=g) * 1.8 + 0.05
    temp[::5] = 0.0  # greedy rows
    temp[1::6] = 1e-4  # tiny but sampled
    top_k = torch.randint(0, V + 3, (R,), generator=g)
    top_k[::3] = 0
    top_p = torch.rand(R, generator=g)
    top_p[::4] = 0.0
    top_p[2::7] = 1.0
    min_p = torch.rand(R, generator=g) * 0.4
    min_p[::2] = 0.0
    if mode == "top_k":
        top_p.zero_(), min_p.zero_()
    elif mode == "top_p":
        top_k.zero_(), min_p.zero_()
    elif mode == "min_p":
        top_k.zero_(), top_p.zero_()
    params = ref.RowParams(temp, top_k, top_p, min_p, torch.randint(0, 2**62, (R,), generator=g),
                           torch.randint(0, 10_000, (R,), generator=g))
    return logits, params


def _fast(logits, params, any_filter=True, **blocks):
    inv_t, greedy = ref.inverse_temperature(params.temperature)
    keys = ref.row_keys(params.seed, params.position)
    d = lambda t: t.to(DEV)  # noqa: E731
    out = triton_sampling.sample(d(logits), d(inv_t), d(greedy), d(params.top_k), d(params.top_p),
                                 d(params.min_p), d(keys), any_filter, **{**BLOCKS, **blocks})
    return out.cpu()


@pytest.mark.parametrize("mode", ["mixed", "top_k", "top_p", "min_p", "ties", "neg_inf"])
def test_fast_sampler_equals_reference(mode):
    # the default pivot count on the mixed cases; wider pivots (fewer passes) elsewhere, for time
    for seed in range(2 if mode == "mixed" else 1):
        logits, params = _case(10, 70, seed, mode)
        expected = ref.sample_reference(logits, params, any_filter=True)
        # single-filter modes launch only their filter's passes
        filters = {"top_k": (True, False, False), "top_p": (False, True, False), "min_p": (False, False, True)}
        got = _fast(logits, params, filters.get(mode, True), pivots=16 if mode == "mixed" else 64)
        assert torch.equal(got, expected), (mode, seed)


def test_filters_really_bind_in_these_cases():
    # the comparison above is only meaningful if the filters change draws
    logits, params = _case(12, 70, 0, "mixed")
    off = ref.RowParams(params.temperature, torch.zeros_like(params.top_k), torch.zeros_like(params.top_p),
                        torch.zeros_like(params.min_p), params.seed, params.position)
    changed = ref.sample_reference(logits, params, True) != ref.sample_reference(logits, off, False)
    assert changed.sum() >= 2


def test_unfiltered_and_flat_rows():
    g = torch.Generator().manual_seed(5)
    logits = 0.01 * torch.randn(8, 200, generator=g)  # nearly flat: a nucleus of most of the vocab
    params = ref.RowParams(torch.full((8,), 1.0), torch.zeros(8, dtype=torch.int64), torch.full((8,), 0.95),
                           torch.zeros(8), torch.arange(8) * 17, torch.arange(8))
    expected = ref.sample_reference(logits, params, any_filter=True)
    assert torch.equal(_fast(logits, params, block=64, search_block=64, pivots=16), expected)
    params.top_p.zero_()
    assert torch.equal(_fast(logits, params, any_filter=False), ref.sample_reference(logits, params, False))


def _penalty_rows(R, V, S, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 3, (S + 1, V), generator=g, dtype=torch.int32) * (torch.rand(S + 1, V, generator=g) < 0.2)
    pen = ref.PenaltyRows(
        slot=torch.randint(0, S + 1, (R,), generator=g),
        presence=torch.rand(R, generator=g) * 4 - 2,
        frequency=torch.rand(R, generator=g) * 4 - 2,
        repetition=torch.rand(R, generator=g) * 2 + 0.2,
        suppress_stop=torch.rand(R, generator=g) < 0.5,
        counts=counts.to(torch.int32),
        prompt_mask=torch.rand(S + 1, V, generator=g) < 0.2,
        stop_mask=torch.rand(S + 1, V, generator=g) < 0.05,
    )
    return 3.0 * torch.randn(R, V, generator=g), pen


def test_penalty_kernel_equals_reference():
    for seed in range(3):
        logits, pen = _penalty_rows(9, 150, 4, seed)
        expected = ref.apply_penalties_reference(logits, pen)
        d = lambda t: t.to(DEV)  # noqa: E731
        out = triton_sampling.apply_penalties(d(logits), d(pen.slot), d(pen.counts), d(pen.prompt_mask),
                                              d(pen.stop_mask), d(pen.presence), d(pen.frequency),
                                              d(pen.repetition), d(pen.suppress_stop), block=64).cpu()
        assert torch.equal(out, expected), seed
        assert not torch.equal(out, logits)
