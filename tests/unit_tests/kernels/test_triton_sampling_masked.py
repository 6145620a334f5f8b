"""Grammar-masked rows in the sort-free Triton sampler: a mask leaves a few allowed tokens and a
plateau of -inf over the rest of the vocabulary. The top-k search must not count that plateau
(no bucket splits 10^5 equal keys, so every masked row used to fall back to the slow whole-row
search: ~2 ms a step on an H100 at Qwen3's vocabulary), and the tokens must stay the reference's,
also for rows with fewer allowed tokens than k, one, or none. Runs in Triton's interpreter on
the CPU; ``cap`` (the candidate buffer) is far below the plateau, as 4,096 is at 151,936."""
import torch

from megatron_async.inference.text_generation_controllers import sampling as ref
from megatron_async.kernels import triton_sampling
from megatron_async.kernels.token_mask import apply_token_bitmask

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = dict(chunk=512, block=128, hist_block=64, search_block=256, pivots=16, cap=64)
ALLOWED = [1, 3, 49, 50, 51, 300, 0, 2000]  # tokens each row's grammar allows (2000: all)


def _masked_case(seed: int, V: int = 2000):
    g = torch.Generator().manual_seed(seed)
    R = len(ALLOWED)
    logits = (3.0 * torch.randn(R, V, generator=g)).to(torch.bfloat16).float()
    allowed = torch.zeros(R, V, dtype=torch.bool)
    for r, n in enumerate(ALLOWED):
        allowed[r, torch.randperm(V, generator=g)[:n]] = True
    words = (V + 31) // 32
    bits = torch.zeros(R, words * 32, dtype=torch.int64)
    bits[:, :V] = allowed.long()
    packed = (bits.view(R, words, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    row_map = torch.arange(R, dtype=torch.int32)
    row_map[-1] = -1  # a row without a grammar among them
    masked = apply_token_bitmask(logits, bitmask, row_map)
    assert torch.equal(torch.isfinite(masked[:-1]), allowed[:-1])
    params = ref.RowParams(torch.ones(R), torch.full((R,), 50, dtype=torch.int64), torch.zeros(R), torch.zeros(R),
                           torch.randint(0, 2**62, (R,), generator=g), torch.randint(0, 10_000, (R,), generator=g))
    return masked, params


def test_masked_rows_search_their_allowed_tokens_only():
    for seed in range(2):
        logits, params = _masked_case(seed)
        expected = ref.sample_reference(logits, params, any_filter=True)
        probe = []
        d = lambda t: t.to(DEV)  # noqa: E731
        got = triton_sampling.sample(d(logits), d(params.temperature), d(params.top_k), d(params.top_p),
                                     d(params.min_p), d(params.seed), d(params.position), (True, False, False),
                                     probe=probe, **BLOCKS).cpu()
        assert torch.equal(got, expected), seed
        drawn_allowed = torch.isfinite(logits)[torch.arange(len(got)), got]
        assert drawn_allowed[[i for i, n in enumerate(ALLOWED) if n]].all(), "a forbidden token was drawn"
        phases = [int(v) for v in probe[0].cpu()]
        # 0: the whole-row search; 3: idle (a row with no finite logit, or k >= V); 1, 2: buffered
        assert 0 not in phases, phases
        assert phases[6] == 3 and all(p in (1, 2) for i, p in enumerate(phases) if i != 6), phases
