"""Stateless sampling: draws keyed by (seed, position, token id), top-k / top-p filtering,
greedy, the distribution of draws, log-probs."""
import math

import pytest
import torch

from megatron_async.inference.text_generation_controllers.sampling import (
    RowParams,
    keep_mask,
    log_probs_of,
    row_keys,
    top_ids_lowest_first,
    sample_reference,
    uniform_noise,
)

V = 32


def _logits(rows: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def _draw(logits, temperature=1.0, top_k=0, top_p=0.0, seed=None, position=None, min_p=0.0):
    R = logits.shape[0]
    full = lambda x, dt: x if torch.is_tensor(x) else torch.full((R,), x, dtype=dt)  # noqa: E731
    seed = torch.arange(R) * 7919 + 1 if seed is None else full(seed, torch.int64)
    position = torch.arange(R) + 10 if position is None else full(position, torch.int64)
    t, k, p = full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32)
    mp = full(min_p, torch.float32)
    any_filter = bool(((k > 1) | ((p > 0) & (p < 1)) | (mp > 0)).any())
    return sample_reference(logits, RowParams(t, k, p, mp, seed, position), any_filter)


def test_greedy_is_argmax():
    logits = _logits(16)
    expected = logits.argmax(-1)
    assert torch.equal(_draw(logits, temperature=0.0), expected)
    mixed_t = torch.tensor([0.0, 1.0] * 8)
    drawn = _draw(logits, temperature=mixed_t)
    assert torch.equal(drawn[::2], expected[::2])


def test_draw_is_independent_of_batch_composition_and_row_order():
    logits = _logits(12)
    seeds, pos = torch.arange(12) * 31 + 5, torch.arange(12) * 3
    params = dict(temperature=torch.linspace(0.5, 1.5, 12), top_k=torch.tensor([0, 5, 0, 3] * 3),
                  top_p=torch.tensor([0.0, 0.0, 0.9] * 4))
    full = _draw(logits, seed=seeds, position=pos, **params)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    permuted = _draw(logits[perm], seed=seeds[perm], position=pos[perm], **{k: v[perm] for k, v in params.items()})
    assert torch.equal(permuted, full[perm])
    for i in range(12):  # alone in its batch
        alone = _draw(logits[i:i + 1], seed=seeds[i:i + 1], position=pos[i:i + 1],
                      **{k: v[i:i + 1] for k, v in params.items()})
        assert alone.item() == full[i].item()


def test_draw_depends_on_seed_and_position():
    logits = torch.zeros(400, V)  # uniform: the draw is all noise
    base = _draw(logits, seed=11, position=torch.arange(400))
    other_seed = _draw(logits, seed=12, position=torch.arange(400))
    high_bits = _draw(logits, seed=11 + 2**32, position=torch.arange(400))
    assert (base != other_seed).float().mean() > 0.8
    assert (base != high_bits).float().mean() > 0.8
    assert len(set(base.tolist())) > V // 2  # positions give different draws
    assert torch.equal(base, _draw(logits, seed=11, position=torch.arange(400)))  # reproducible


def test_top_k_never_samples_outside_the_top_k():
    logits = _logits(2000, seed=1, scale=0.5)  # flat-ish: without the filter, draws spread out
    for k in (2, 3, 8):  # top_k 1 is greedy: the context sends it as temperature 0
        drawn = _draw(logits, temperature=2.0, top_k=k)
        topk = logits.topk(k, dim=-1).indices
        assert (topk == drawn[:, None]).any(-1).all(), k
    assert len(set(_draw(logits[:1].expand(2000, V), temperature=2.0, top_k=3).tolist())) == 3


def _nucleus(logits: torch.Tensor, p: float) -> list[set[int]]:
    probs = torch.softmax(logits, -1)
    out = []
    for row in probs:
        order = row.argsort(descending=True).tolist()
        keep, mass = set(), 0.0
        for t in order:
            keep.add(t)
            mass += row[t].item()
            if mass >= p:
                break
        out.append(keep)
    return out


def test_top_p_never_samples_outside_the_nucleus():
    logits = _logits(1000, seed=2)
    for p in (0.3, 0.8):
        drawn = _draw(logits, top_p=p).tolist()
        nuclei = _nucleus(logits, p)
        assert all(t in n for t, n in zip(drawn, nuclei)), p
    # the nucleus is taken on the temperature-scaled distribution
    drawn = _draw(logits, temperature=0.5, top_p=0.5).tolist()
    assert all(t in n for t, n in zip(drawn, _nucleus(logits / 0.5, 0.5)))


def test_keep_mask_is_exactly_top_k_and_nucleus():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    k = torch.tensor([2, 0])
    p = torch.tensor([0.0, 0.9])
    none = torch.zeros(2)
    keep = keep_mask(logits, k, p, none)
    assert keep[0].tolist() == [True, True, False, False, False]
    probs = torch.softmax(logits[1], -1)  # [.01, .03, .09, .24, .64]: .64 + .24 < .9 <= .64 + .24 + .09
    assert probs[3:].sum() < 0.9 <= probs[2:].sum()
    assert keep[1].tolist() == [False, False, True, True, True]
    assert keep_mask(logits, torch.tensor([0, 5]), torch.tensor([0.0, 1.0]), none).all()  # off values


def test_keep_mask_keeps_ties_and_min_p_is_relative_to_the_top_token():
    s = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    none = torch.zeros(1)
    assert keep_mask(s, torch.tensor([2]), none, none)[0].tolist() == [True, True, True, True, False, False]
    # min_p: keep p_i >= min_p * p_max, i.e. exp(s_i - s_max) >= min_p
    for mp in (0.3, 0.37, 0.4, 0.1):
        keep = keep_mask(s, torch.tensor([0]), none, torch.tensor([mp]))[0]
        probs = torch.softmax(s[0].double(), -1)
        assert keep.tolist() == (probs >= mp * probs.max()).tolist(), mp
    # top-p: the tie group that crosses the mass is kept whole
    probs = torch.softmax(s[0].double(), -1)
    p = float(probs[0] + probs[1] * 0.5)  # crosses inside the tie group of 2.0
    assert keep_mask(s, torch.tensor([0]), torch.tensor([p]), none)[0].tolist() == [True] * 4 + [False] * 2


def test_low_temperature_behaves_like_greedy():
    logits = _logits(500, seed=4)
    assert torch.equal(_draw(logits, temperature=1e-3), logits.argmax(-1))


def test_tiny_temperature_is_still_argmax():
    logits = _logits(200, seed=6, scale=10.0)  # realistic logit magnitudes
    assert torch.equal(_draw(logits, temperature=1e-38), logits.argmax(-1))


def test_draws_follow_softmax():
    logits = torch.tensor([[1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0]])
    n = 20000
    drawn = _draw(logits.expand(n, -1).contiguous(), seed=123, position=torch.arange(n))
    counts = torch.bincount(drawn, minlength=8).double()
    expected = torch.softmax(logits[0].double(), -1) * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 30.0, (chi2, counts.tolist(), expected.tolist())  # 7 dof: p ~ 1e-4 at 30
    # temperature 2 flattens: the same test against softmax(logits / 2)
    drawn = _draw(logits.expand(n, -1).contiguous(), temperature=2.0, seed=321, position=torch.arange(n))
    counts = torch.bincount(drawn, minlength=8).double()
    expected = torch.softmax(logits[0].double() / 2, -1) * n
    assert (((counts - expected) ** 2) / expected).sum().item() < 30.0


def test_noise_is_uniform_in_open_interval():
    keys = row_keys(torch.arange(64) * 1000003, torch.arange(64))
    u = uniform_noise(keys, 1024)
    assert u.shape == (64, 1024) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    hist = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert (hist / u.numel() - 0.1).abs().max() < 0.01
    # keys are 32-bit values and neighbouring positions are decorrelated
    assert (keys >= 0).all() and (keys < 2**32).all()
    corr = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]
    assert abs(corr.item()) < 0.02


def test_log_probs_of_equals_log_softmax_gather():
    logits = _logits(6, seed=5)
    tokens = torch.tensor([0, 3, 31, 7, 7, 12])
    chosen, vals, ids = log_probs_of(logits, tokens, top_n=4)
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(chosen, lp[torch.arange(6), tokens])
    ref_vals, ref_ids = lp.topk(4, -1)
    assert torch.allclose(vals, ref_vals) and torch.equal(ids, ref_ids)
    chosen0, none_v, none_i = log_probs_of(logits, tokens, top_n=0)
    assert torch.equal(chosen0, chosen) and none_v is None and none_i is None
    assert math.isclose(torch.logsumexp(lp[0], -1).item(), 0.0, abs_tol=1e-5)


def test_top_n_ties_go_to_the_lowest_id_whatever_n():
    """bf16 log-probs tie often; a CUDA graph asks topk for GRAPH_TOP_N alternatives and an eager
    step for its own maximum, so the reported ids must not depend on n."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 2, (64, 200), generator=g).float() * 0.5  # few distinct values: many ties
    x[:, 7] = -0.0
    x[:5] = float("-inf")
    x[5, :] = 1.0
    ref = torch.stack([torch.tensor(sorted(range(200), key=lambda j: (-r[j].item(), j))) for r in x])
    for n in (1, 2, 5, 20, 200):
        ids = top_ids_lowest_first(x, n)
        assert torch.equal(ids, ref[:, :n]), n
    _, vals, ids = log_probs_of(x[5:], torch.zeros(59, dtype=torch.long), top_n=3)
    assert torch.equal(ids, ref[5:, :3]) and torch.allclose(vals, torch.log_softmax(x[5:], -1).gather(-1, ids))


@pytest.mark.parametrize("keep_four", [dict(top_k=4), dict(top_p=0.1), dict(min_p=0.9)])
def test_filtered_tokens_get_no_mass_even_with_extreme_noise(keep_four):
    # Each filter keeps only the four tokens at 50; the other 28 sit one logit below, so at
    # temperature 5 (ratio 0.82) an unfiltered draw lands on them 85 % of the time.
    logits = torch.full((300, V), 49.0)
    logits[:, :4] = 50.0
    drawn = _draw(logits, temperature=5.0, **keep_four)
    assert (drawn < 4).all()
    assert set(drawn.tolist()) == {0, 1, 2, 3}
    assert (_draw(logits, temperature=5.0) >= 4).float().mean() > 0.7  # the filter is what held them


def test_noise_never_overturns_a_huge_logit_gap():
    logits = torch.zeros(300, V)
    logits[:, -1] = 50.0  # best token
    assert (_draw(logits) == V - 1).all()


def test_min_p_never_samples_below_the_threshold():
    logits = _logits(1500, seed=8, scale=1.5)
    for mp in (0.05, 0.3):
        drawn = _draw(logits, temperature=1.3, min_p=mp)
        probs = torch.softmax(logits / 1.3, -1)
        chosen = probs.gather(-1, drawn[:, None])[:, 0]
        assert (chosen >= mp * probs.max(-1).values * (1 - 1e-5)).all(), mp
        assert len(set(drawn[:1].tolist())) == 1
    flat = _draw(logits[:1].expand(3000, V), temperature=1.3, min_p=0.3)
    probs = torch.softmax(logits[0] / 1.3, -1)
    assert set(flat.tolist()) == set((probs >= 0.3 * probs.max()).nonzero()[:, 0].tolist())
