"""The Triton log-probs (kernels/triton_log_probs.py) against the torch reference
(``sampling.log_probs_of``) on fresh random logits: float32 and bf16, heavy ties, -0.0,
-inf entries and all -inf rows, top-n 0 / 1 / 5 / 20 (the kernels always compute the top 20
and return its head). Top-n ids must be exactly the reference's (ties to the lowest id);
values agree to float32 rounding of the log-sum-exp, and bit for bit in batch-invariant mode.
Interpreter on CPU (small chunks, so rows span several chunks and the last one is ragged)."""
import pytest
import torch

from megatron_async.inference.text_generation_controllers.sampling import log_probs_of
from megatron_async.kernels import triton_log_probs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(R: int, V: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = 4.0 * torch.randn(R, V, generator=g)
    x[1] = torch.randint(-3, 2, (V,), generator=g).float() * 0.5  # few distinct values: ties everywhere
    x[1, 3::7] = -0.0
    x[2][torch.rand(V, generator=g) < 0.4] = float("-inf")
    x[3] = float("-inf")
    x[4, : V - 3] = float("-inf")  # fewer finite values than top-n: -inf ids fill up, lowest first
    x[5] = 1.0  # one value: the first ids
    return x.to(dtype).to(DEV)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_n", [0, 1, 5, 20])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_equals_the_reference(dtype, top_n, batch_invariant):
    R, V = 6, 700
    x = _logits(R, V, seed=top_n + 100 * batch_invariant, dtype=dtype)
    tokens = torch.randint(0, V, (R,), generator=torch.Generator().manual_seed(top_n)).to(DEV)
    ref = log_probs_of(x, tokens, top_n, batch_invariant)
    got = triton_log_probs.log_probs(x, tokens, top_n, batch_invariant, chunk=256)
    if batch_invariant:
        assert _same(got[0], ref[0])
    else:
        torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0, equal_nan=True)
        assert not _same(got[0], torch.zeros_like(got[0]))
    if top_n == 0:
        assert got[1] is None and got[2] is None
        return
    assert got[2].dtype == torch.int64 and torch.equal(got[2], ref[2])
    if batch_invariant:
        assert _same(got[1], ref[1])
    else:
        torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=0, equal_nan=True)
    assert torch.equal(got[2][5], torch.arange(top_n, device=DEV))
    if top_n > 3:  # the three finite values first, then -inf ids from the lowest
        assert sorted(got[2][4, :3].tolist()) == [V - 3, V - 2, V - 1]
        assert torch.equal(got[2][4, 3:], torch.arange(top_n - 3, device=DEV))


def test_one_chunk_and_a_ragged_last_chunk_agree():
    """The chunking is an implementation detail: a row in one chunk or in many gives the same ids."""
    x = _logits(6, 777, seed=9, dtype=torch.float32)
    tokens = torch.arange(6, device=DEV) * 100
    one = triton_log_probs.log_probs(x, tokens, 5, chunk=1024)
    many = triton_log_probs.log_probs(x, tokens, 5, chunk=triton_log_probs.GROUP)
    assert torch.equal(one[2], many[2])
    torch.testing.assert_close(one[0], many[0], atol=1e-5, rtol=0, equal_nan=True)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_top_n_in_one_group_and_spread_over_many(batch_invariant):
    """Rows with more groups than n, so the per-row bound skips chunks: the n best logits in one
    group (its chunk extracts n keys), one per group, in the last ragged group, and ties at the bound."""
    R, V, n = 5, 40 * triton_log_probs.GROUP + 17, 20
    g = torch.Generator().manual_seed(11)
    x = torch.randn(R, V, generator=g)
    x[0, 300:300 + 2 * n] = 10 + torch.rand(2 * n, generator=g)  # more than n candidates in one group
    x[1, :: triton_log_probs.GROUP] = 10.0  # one per group, all tied
    x[2, V - 10:] = 10 + torch.arange(10.0)  # in the ragged last group
    x[3, :] = torch.round(x[3] * 2) / 2  # heavy ties at every bound
    x = x.to(DEV)
    tokens = torch.arange(R, device=DEV)
    ref = log_probs_of(x, tokens, n, batch_invariant)
    got = triton_log_probs.log_probs(x, tokens, n, batch_invariant, chunk=2 * triton_log_probs.GROUP)
    assert torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=0)
    assert torch.equal(got[2][1], torch.arange(n, device=DEV) * triton_log_probs.GROUP)


def test_dispatch_takes_the_kernel_up_to_its_limit(monkeypatch):
    calls = []
    kernel = triton_log_probs.log_probs
    monkeypatch.setattr(triton_log_probs, "log_probs", lambda *a, **k: calls.append(a[2]) or kernel(*a, **k))
    x = _logits(6, 300, seed=4, dtype=torch.bfloat16)
    tokens = torch.zeros(6, dtype=torch.int64, device=DEV)
    limit = triton_log_probs.MAX_TOP_N
    for n in (3, limit, limit + 1):
        got = log_probs_of(x, tokens, n, triton=True)
        assert torch.equal(got[2], log_probs_of(x, tokens, n)[2])
    assert calls == [3, limit]  # beyond the limit: the torch reference


def test_kernels_compute_the_log_prob_graphs_top_n():
    """The one build warm-up makes (its log-prob graphs' top-n) must serve every eager step too."""
    from megatron_async.inference.text_generation_controllers.graph_plan import GRAPH_TOP_N

    assert triton_log_probs.MAX_TOP_N == GRAPH_TOP_N


def test_a_row_gives_the_same_bits_alone_and_in_a_batch():
    """Every reduction runs inside one row in a fixed order, in both modes."""
    x = _logits(6, 700, seed=21, dtype=torch.bfloat16)
    tokens = torch.arange(6, device=DEV) * 7
    for inv in (False, True):
        full = triton_log_probs.log_probs(x, tokens, 5, inv, chunk=256)
        for lo, hi in ((0, 1), (2, 5)):
            part = triton_log_probs.log_probs(x[lo:hi], tokens[lo:hi], 5, inv, chunk=256)
            assert all(_same(p, f[lo:hi]) for p, f in zip(part, full))


def test_batch_invariant_paths_take_one_lse_of_the_logits_as_given(monkeypatch):
    """On CUDA the lse kernel's summation order follows its register layout, which follows the
    load width of the input dtype: an lse of a float32 copy of bf16 logits differs in the last
    bit from the lse of the bf16 logits (the reference once took it from a float32 copy and
    the kernel from the bf16 logits: 64-row steps differed). The interpreter sums the same way
    for every dtype, so here the lse's bits are made to depend on the dtype: both paths must
    still agree bit for bit, and with the engine's dispatch (``triton=True``)."""
    from megatron_async.kernels import triton_log_softmax

    real = triton_log_softmax.row_lse
    monkeypatch.setattr(triton_log_softmax, "row_lse",
                        lambda x: real(x) + (2.0**-12 if x.dtype != torch.float32 else 0.0))
    x = _logits(6, 700, seed=33, dtype=torch.bfloat16)
    tokens = torch.arange(6, device=DEV) * 5
    ref = log_probs_of(x, tokens, 5, batch_invariant=True)
    got = log_probs_of(x, tokens, 5, batch_invariant=True, triton=True)
    kernel = triton_log_probs.log_probs(x, tokens, 5, True, chunk=256)
    assert all(_same(a, b) and _same(a, c) for a, b, c in zip(ref, got, kernel))
    finite = ref[0].isfinite()
    assert _same(ref[0][finite], (x.float().gather(-1, tokens[:, None])[:, 0] - (real(x) + 2.0**-12))[finite])


VOCAB = 151936  # Qwen3's


def _step_logits(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 logits of a step (many ties) with a 10-way tie at the top of every row and every
    other entry of row 0 -inf, and a token per row."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (3 * torch.randn(rows, vocab, device=DEV, generator=g)).to(torch.bfloat16)
    x[:, 100:110] = x.max()  # a tie at the top: the lowest ids first
    x[0, ::2] = float("-inf")
    return x, torch.randint(0, vocab, (rows,), device=DEV, generator=g)


def _equal_the_reference(x: torch.Tensor, tokens: torch.Tensor, **launch) -> None:
    """Top-n 0 / 5 / 20, default and batch-invariant: top-n ids equal, values to float32
    rounding of the log-sum-exp (2e-5), bit for bit in batch-invariant mode; a row alone gives
    its bits in the batch."""
    for n in (0, 5, 20):
        for inv in (False, True):
            ref = log_probs_of(x, tokens, n, inv)
            got = triton_log_probs.log_probs(x, tokens, n, inv, **launch)
            close = _same if inv else (lambda a, b: torch.allclose(a, b, atol=2e-5, rtol=0, equal_nan=True))
            assert close(got[0], ref[0]), f"chosen log-probs, top-{n}, batch_invariant={inv}"
            if n:
                assert torch.equal(got[2], ref[2]), f"top ids, top-{n}, batch_invariant={inv}"
                assert close(got[1], ref[1]), f"top values, top-{n}, batch_invariant={inv}"
            alone = triton_log_probs.log_probs(x[-1:], tokens[-1:], n, inv, **launch)
            assert _same(alone[0], got[0][-1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled layouts)")
@pytest.mark.parametrize("rows", [1, 64, 128])
def test_cuda_log_probs_equal_the_reference(rows):
    """bf16 logits at Qwen3's vocabulary, the engine's step sizes, in both modes."""
    _equal_the_reference(*_step_logits(rows, VOCAB, seed=rows))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled layouts)")
@pytest.mark.parametrize("chunk", [2048, 4096, 8192])
@pytest.mark.parametrize("warps", [4, 8, 16])
def test_cuda_launch_settings_equal_the_reference(chunk, warps):
    """Every chunk / warps launch at 128 rows (the kernels always compute the top 20)."""
    _equal_the_reference(*_step_logits(128, VOCAB, seed=chunk + warps), chunk=chunk, num_warps=warps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_negative_token_asks_for_the_rows_greedy_token(dtype):
    """Greedy rows take their token from the log-prob pass (first index of the largest logit,
    as argmax, ties, -0.0 and -inf rows included), written back; other rows keep theirs."""
    R, V = 6, 700
    x = _logits(R, V, seed=41, dtype=dtype)
    x[0, 10], x[0, 20] = 50.0, 50.0  # a tie at the top: the lower id
    x[1, 5], x[1, 3] = 7.0, 7.0  # ties of the few distinct values, lowest first
    given = torch.tensor([-1, -1, 9, -1, -1, 4], device=DEV)
    tokens = given.clone()
    got = triton_log_probs.log_probs(x, tokens, 5, chunk=256)
    want = torch.where(given < 0, x.float().argmax(-1), given)
    assert torch.equal(tokens, want) and tokens[0] == 10 and tokens[1] == 3
    ref = log_probs_of(x, want, 5)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0, equal_nan=True)
    assert torch.equal(got[2], ref[2])
