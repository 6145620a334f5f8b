"""The sort-free Triton sampler and penalty kernel against the torch reference definition
(sampling.py), on fresh random logits: many seeds, top-k / top-p / min-p alone and mixed,
greedy rows, tiny and huge temperatures, heavy ties, -inf entries, k = 1 / V, p -> 0 / 1.
Runs in Triton's interpreter on the CPU (tiny shapes, small blocks so the block loops,
bucket levels and searches really iterate). Each threshold search ends either from the
compacted candidate buffer or, for rows whose candidates never fit it, from a whole-row
search; the tests run both (a small ``cap`` forces the second) and check via ``probe``
that each really ran."""
import pytest
import torch

from megatron_async.inference.text_generation_controllers import sampling as ref
from megatron_async.kernels import triton_sampling

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = dict(chunk=128, block=64, hist_block=32, search_block=256, pivots=16)  # V > chunk: several chunks and blocks per pass
BUFFERED, WHOLE_ROW = (1, 2), (0,)


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
    temp[3::8] = 50.0  # nearly flat
    top_k = torch.randint(0, V + 3, (R,), generator=g)
    top_k[::3] = 0
    top_k[4::9] = 1
    top_k[7::11] = V
    top_p = torch.rand(R, generator=g)
    top_p[::4] = 0.0
    top_p[2::7] = 1.0
    top_p[5::13] = 1e-6  # p -> 0: the top token (and its ties) only
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


def _fast(logits, params, any_filter=True, probe=None, **blocks):
    d = lambda t: t.to(DEV)  # noqa: E731
    out = triton_sampling.sample(d(logits), d(params.temperature), d(params.top_k), d(params.top_p),
                                 d(params.min_p), d(params.seed), d(params.position), any_filter,
                                 probe=probe, **{**BLOCKS, **blocks})
    return out.cpu()


def _phases(probe) -> set[int]:
    return {int(v) for t in probe for v in t.cpu()}


@pytest.mark.parametrize("mode,cap", [("mixed", 512), ("mixed", 0), ("top_k", 512), ("top_p", 0), ("min_p", 512),
                                      ("ties", 512), ("ties", 0), ("neg_inf", 512)])
def test_fast_sampler_equals_reference(mode, cap):
    # cap 512 > V: every searching row finishes from its buffer; cap 0: every one searches the whole row
    filters = {"top_k": (True, False, False), "top_p": (False, True, False), "min_p": (False, False, True)}
    for seed in range(2 if mode == "mixed" else 1):
        logits, params = _case(12, 150, seed, mode)
        expected = ref.sample_reference(logits, params, any_filter=True)
        probe = []  # single-filter modes launch only their filter's stage
        got = _fast(logits, params, filters.get(mode, True), probe=probe, cap=cap)
        assert torch.equal(got, expected), (mode, seed, cap)
        if mode != "min_p":
            ran = _phases(probe)
            assert ran & set(BUFFERED if cap > 150 else WHOLE_ROW), (mode, ran)


@pytest.mark.parametrize("near_loop", [0, 64])
def test_near_best_elements_scored_either_way(near_loop):
    """The draw's exact scores for the elements its fast bound keeps: all as a vector (0) or one
    by one (64 >= a block): the reference's tokens, ties and -inf entries included."""
    for mode in ("mixed", "ties", "neg_inf"):
        logits, params = _case(12, 150, 3, mode)
        for any_filter in (True, False):
            expected = ref.sample_reference(logits, params, any_filter=any_filter)
            assert torch.equal(_fast(logits, params, any_filter, near_loop=near_loop), expected), (mode, any_filter)


def test_near_tied_leaders_drawn_by_their_exact_scores():
    """Two tokens within a few ulps (or tied): the draw's exact scores pick, the first index on a tie."""
    from tests.helpers.sampler_cases import near_tie_case

    logits, params, expected = near_tie_case(18, 300, torch.Generator(device=DEV).manual_seed(4))
    for near_loop in (0, 4):
        for filters in (False, True):
            got = triton_sampling.sample(logits, params.temperature, params.top_k, params.top_p, params.min_p,
                                         params.seed, params.position, filters, near_loop=near_loop,
                                         **BLOCKS)
            assert torch.equal(got.cpu(), expected.cpu()), (near_loop, filters)


def test_buckets_narrow_and_compact_on_wide_rows():
    # several chunks and a wide spread: rows pick a level-0 or level-1 bucket, then compact
    g = torch.Generator().manual_seed(11)
    R, V = 8, 400
    logits = torch.randn(R, V, generator=g) * torch.linspace(0.2, 4.0, R)[:, None]
    params = ref.RowParams(torch.full((R,), 0.9), torch.tensor([0, 3, 40, 300, 0, 0, 25, 399]),
                           torch.tensor([0.9, 0.0, 0.0, 0.0, 0.5, 0.97, 0.8, 0.99]), torch.zeros(R),
                           torch.arange(R) * 7 + 1, torch.arange(R) + 3)
    expected = ref.sample_reference(logits, params, any_filter=True)
    for cap in (16, 0):
        probe = []
        assert torch.equal(_fast(logits, params, True, probe=probe, cap=cap), expected), cap
        # phase 2: compacted after level 0; 1: needed level 1 first; 0: whole-row search
        assert _phases(probe) >= ({1, 2} if cap else {0}), (cap, _phases(probe))


def test_filters_really_bind_in_these_cases():
    # the comparison above is only meaningful if the filters change draws
    logits, params = _case(12, 150, 0, "mixed")
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
    assert torch.equal(_fast(logits, params), expected)
    params.top_p.zero_()
    assert torch.equal(_fast(logits, params, any_filter=False), ref.sample_reference(logits, params, False))


def test_combined_filters_and_tie_plateau():
    # top-k + top-p + min-p on the same rows; one row a plateau of equal logits at the cut
    g = torch.Generator().manual_seed(9)
    R, V = 6, 300
    logits = 2.0 * torch.randn(R, V, generator=g)
    logits[0, 100:220] = 1.25
    logits[0, :5] = 4.0
    params = ref.RowParams(torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0, 1.0]), torch.tensor([50, 120, 7, 299, 1, 200]),
                           torch.tensor([0.6, 0.9, 0.3, 0.99, 0.5, 1e-7]), torch.tensor([0.0, 0.05, 0.01, 0.0, 0.3, 0.0]),
                           torch.arange(R) * 31, torch.arange(R) * 5)
    expected = ref.sample_reference(logits, params, any_filter=True)
    for cap in (40, 0):
        assert torch.equal(_fast(logits, params, True, cap=cap), expected), cap


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


@pytest.mark.parametrize("dtype,seed", [(torch.bfloat16, 0), (torch.float16, 1)])  # one seed per dtype, both seeds run
def test_model_dtype_logits_sample_as_their_float32_copy(dtype, seed):
    """The engine hands the Triton sampler the LM head's bf16 logits (no float32 copy of the
    [R, V] tensor): every kernel reads them as float32, exactly, so tokens and penalised logits
    equal those of the upcast copy, and the copy's reference draws."""
    logits, params = _case(12, 150, seed, "mixed")
    low = logits.to(dtype)
    up = low.float()
    expected = ref.sample_reference(up, params, any_filter=True)
    assert torch.equal(_fast(low, params, cap=512), expected)
    assert torch.equal(_fast(low, params, cap=0), expected)
    _, pen = _penalty_rows(12, 150, 4, seed)
    d = lambda t: t.to(DEV)  # noqa: E731
    args = [d(pen.slot), d(pen.counts), d(pen.prompt_mask), d(pen.stop_mask), d(pen.presence), d(pen.frequency),
            d(pen.repetition), d(pen.suppress_stop)]
    out = triton_sampling.apply_penalties(d(low), *args, block=64).cpu()
    assert out.dtype == torch.float32 and torch.equal(out, ref.apply_penalties_reference(up, pen))


@pytest.mark.parametrize("seed", [0, 1])
def test_top_p_candidate_first_keeps_and_falls_back(seed):
    # Every row samples with a binding top-p, so each one either keeps its unfiltered draw
    # (phase 3: no search) or searches; both must happen, and the tokens must be the reference's
    # and the search-only path's.
    logits, params = _case(16, 150, seed, "mixed" if seed else "top_p")  # seed 1: top-k and min-p rows too
    g = torch.Generator().manual_seed(100 + seed)
    params.temperature.copy_(torch.rand(16, generator=g) * 1.5 + 0.3)
    params.top_p.copy_(torch.rand(16, generator=g) * 0.9 + 0.05)
    params.min_p[::3] = 0.01
    expected = ref.sample_reference(logits, params, any_filter=True)
    probe = []
    flags = (seed == 1, True, True)
    got = _fast(logits, params, flags, probe=probe)
    assert torch.equal(got, expected)
    assert torch.equal(_fast(logits, params, flags, candidate_first=False), expected)
    phases = [int(v) for v in probe[-1]]  # the top-p stage's
    assert 3 in phases and set(phases) - {3}, phases  # some rows kept their draw, some searched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_argmax_equals_torch_first_index(dtype):
    """Greedy steps' argmax over (rows x chunks): the first largest index, as torch's, on ties
    inside a block, across blocks and across chunks, -inf entries and an all -inf row."""
    g = torch.Generator().manual_seed(3)
    R, V = 9, 1000  # chunks of 128 in blocks of 64: 8 chunks, the last one partial
    x = torch.round(3.0 * torch.randn(R, V, generator=g)) / 2
    x[torch.rand(R, V, generator=g) < 0.2] = float("-inf")
    top = x.max() + 1
    x[0, [10, 20]] = top  # same block
    x[1, [70, 100]] = top  # same chunk, two blocks
    x[2, [130, 900]] = top  # two chunks
    x[3, [999, 998]] = top  # the partial last chunk
    x[4] = float("-inf")
    x[5, 0] = top
    x = x.to(dtype)
    got = triton_sampling.argmax(x.to(DEV), chunk=128, block=64).cpu()
    assert torch.equal(got, x.argmax(-1))
    assert got[:4].tolist() == [10, 70, 130, 998] and got[4] == 0 and got[5] == 0
