"""Batch-invariant kernels: the same row gives the same bits at batch 1, 7 and 64 (matmul,
RMSNorm, fused add + RMSNorm, log-softmax, sampling), and attention gives a token the same
bits whether it is decoded alone, decoded among other rows, or computed inside a prefill
chunk of any length. Interpreter on CPU, compiled on CUDA; tiny shapes."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from megatron_async.forward_batch import AttentionMetadata  # noqa: E402
from megatron_async.inference.text_generation_controllers import sampling  # noqa: E402
from megatron_async.kernels import triton_rmsnorm  # noqa: E402
from megatron_async.kernels.attention import attend  # noqa: E402
from megatron_async.kernels.triton_invariant_matmul import invariant_linear, launch_tiles, tile_config  # noqa: E402
from megatron_async.kernels.triton_log_softmax import log_softmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
BATCHES = (1, 7, 64)


def _randn(*shape, seed, dtype=DTYPE):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)


def _assert_rows_invariant(fn, x: torch.Tensor, *more: torch.Tensor) -> None:
    """fn over the first b rows, for b in BATCHES, and over shuffled rows: every row's bits
    equal those it has in the full batch."""
    full = fn(x, *more)
    for b in BATCHES:
        part = fn(x[:b], *(m[:b] for m in more))
        assert torch.equal(part, full[:b]), f"batch {b} changed a row"
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1)).to(x.device)
    assert torch.equal(fn(x[perm], *(m[perm] for m in more)), full[perm]), "row order changed a row"


@pytest.mark.parametrize("k,n,bias", [(40, 50, True), (64, 96, False), (1100, 64, True)])
def test_matmul_rows_invariant_and_correct(k, n, bias):
    if k == 1100:  # a narrow weight with a long K: the fixed K split and its ordered sum
        assert tile_config(n, k, torch.device(DEVICE)).split_k > 1
    w, x = _randn(n, k, seed=1), _randn(64, k, seed=2)
    b = _randn(n, seed=3) if bias else None
    _assert_rows_invariant(lambda t: invariant_linear(t, w, b), x)
    if k == 1100:  # the K ranges added in one program (large batches) or by the sum kernel: same bits
        assert torch.equal(invariant_linear(x, w, b, in_program=True), invariant_linear(x, w, b, in_program=False))
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = dict(rtol=1e-4, atol=1e-3) if DTYPE == torch.float32 else dict(rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(invariant_linear(x, w, b).float(), ref, **tol)


def test_launch_by_row_count_keeps_the_k_order(monkeypatch):
    """``launch_tiles`` may retile the output by row count, never change the K order (BLOCK_K, the K
    split): that order is what makes a row's bits independent of the batch. An explicit launch that
    changes it is refused."""
    import dataclasses

    from megatron_async.kernels import triton_invariant_matmul

    monkeypatch.setattr(triton_invariant_matmul, "num_compute_units", lambda device: 132)  # an H100
    cuda = torch.device("cuda")  # tile choice only: nothing launches
    for n, k, swiglu in ((1024, 2048, False), (1024, 3072, False), (4096, 1024, False), (6144, 1024, True),
                         (151936, 1024, False)):
        base = tile_config(n, k, cuda)
        launches = {m: launch_tiles(m, n, k, cuda, swiglu) for m in (1, 64, 128, 129, 1023, 2048, 4096, 8192)}
        assert {(t.block_k, t.split_k) for t in launches.values()} == {(base.block_k, base.split_k)}
        assert launches[8192].block_m == 128 and launches[8192].num_warps == 8  # prefill row counts
        lm_head = n == 151936  # 1,187 column tiles: enough programs at any row count
        assert (launches[128] == base) == lm_head  # decode: 32 columns where the device would idle
        assert (launches[129] == base) != lm_head  # past decode sizes: 128-row tiles once they fill it
    w, x = _randn(64, 1100, seed=1), _randn(4, 1100, seed=2)
    cfg = tile_config(64, 1100, torch.device(DEVICE))
    for bad in (dataclasses.replace(cfg, block_k=2 * cfg.block_k), dataclasses.replace(cfg, split_k=cfg.split_k + 1)):
        with pytest.raises(ValueError, match="K order"):
            invariant_linear(x, w, tiles=bad)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072), (4096, 1024)])
def test_gpu_matmul_prefill_rows_equal_decode_rows(n, k):
    """The 0.6B's o_proj / down_proj / qkv shapes: rows of an 8,192- and a 2,048-row prefill GEMM
    (the TMA kernel; o_proj / down_proj add their K ranges in one program) equal the same rows in 1-
    and 64-row GEMMs (the invariant kernel; a program per K range) and in the invariant kernel's own
    8,192-row launch."""
    from megatron_async.kernels import triton_tma_linear

    assert launch_tiles(8192, n, k, torch.device(DEVICE)) != launch_tiles(64, n, k, torch.device(DEVICE))
    w, x, b = _randn(n, k, seed=1), _randn(8192, k, seed=2), _randn(n, seed=3)
    assert triton_tma_linear.takes(x, w) and triton_tma_linear.takes(x[:2048], w)
    assert not triton_tma_linear.takes(x[:64], w)
    full = invariant_linear(x, w, b)
    own = invariant_linear(x, w, b, tiles=launch_tiles(8192, n, k, torch.device(DEVICE)))  # (explicit: no TMA)
    assert torch.equal(full, own), "the TMA kernel's bits differ from the invariant kernel's"
    assert torch.equal(invariant_linear(x[:2048], w, b), full[:2048])
    for start, rows in ((0, 1), (100, 64), (8192 - 64, 64)):
        assert torch.equal(invariant_linear(x[start:start + rows], w, b), full[start:start + rows]), (start, rows)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("m,inter,k,bias", [(64, 48, 40, True), (37, 40, 96, False)])
def test_swiglu_equals_matmul_then_silu_mul(m, inter, k, bias):
    """The fused gate_up + SiLU-mul kernel: the unfused mode's bits (matmul, then silu_and_mul), rows
    invariant; a weight whose tiles cut K is left to the unfused path."""
    from megatron_async.kernels.triton_act import silu_and_mul
    from megatron_async.kernels.triton_invariant_matmul import invariant_swiglu

    w, x = _randn(2 * inter, k, seed=11), _randn(m, k, seed=12)
    b = _randn(2 * inter, seed=13) if bias else None
    assert tile_config(2 * inter, k, torch.device(DEVICE)).split_k == 1
    fused = invariant_swiglu(x, w, b)
    assert fused.shape == (m, inter) and torch.equal(fused, silu_and_mul(invariant_linear(x, w, b)))
    _assert_rows_invariant(lambda t: invariant_swiglu(t, w, b), x)
    if DEVICE == "cpu":  # the CPU tiles cut K of a narrow weight with K > 32
        assert invariant_swiglu(_randn(4, 100, seed=14), _randn(64, 100, seed=15)) is None


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_gpu_swiglu_prefill_rows_equal_decode_rows():
    """The 0.6B's gate_up [6,144, 1,024]: fused rows of an 8,192-row step equal the unfused path and
    the same rows in 1- and 64-row steps, from the invariant kernel and from the default mode's fused
    kernel the mode runs on a GPU (linear_op.invariant_swiglu)."""
    from megatron_async.kernels import linear_op
    from megatron_async.kernels.triton_act import silu_and_mul
    from megatron_async.kernels.triton_invariant_matmul import invariant_swiglu

    assert launch_tiles(8192, 6144, 1024, torch.device(DEVICE), swiglu=True) != launch_tiles(
        64, 6144, 1024, torch.device(DEVICE), swiglu=True)
    w, x = _randn(6144, 1024, seed=1), _randn(8192, 1024, seed=2)
    full = invariant_swiglu(x, w)
    assert torch.equal(full, silu_and_mul(invariant_linear(x, w)))
    for fused in (invariant_swiglu, linear_op.invariant_swiglu):
        assert torch.equal(fused(x, w), full)
        for start, rows in ((0, 1), (5, 7), (100, 64), (1000, 300), (8192 - 64, 64)):
            assert torch.equal(fused(x[start:start + rows], w), full[start:start + rows]), (fused, start, rows)


def test_rmsnorm_and_fused_add_rows_invariant():
    w = _randn(48, seed=4)
    x, r = _randn(64, 48, seed=5), _randn(64, 48, seed=6)
    _assert_rows_invariant(lambda t: triton_rmsnorm.rms_norm(t, w, 1e-6), x)
    _assert_rows_invariant(lambda t, res: torch.cat(triton_rmsnorm.add_rms_norm(t, res, w, 1e-6), -1), x, r)


def test_log_softmax_rows_invariant_and_correct():
    x = _randn(64, 1000, seed=7, dtype=torch.float32) * 4
    x[3, :50] = float("-inf")
    _assert_rows_invariant(log_softmax, x)
    out, ref = log_softmax(x), torch.log_softmax(x, -1)
    assert torch.equal(out.isinf(), ref.isinf())
    torch.testing.assert_close(out[~ref.isinf()], ref[~ref.isinf()], rtol=1e-5, atol=1e-5)


def test_sampling_and_log_probs_rows_invariant():
    """Sampling is per row by definition (exact fixed-point masses); check it with filters,
    ties and log-probs in the mode, on the reference and (on CUDA) the Triton sampler."""
    V = 1000
    logits = _randn(64, V, seed=8, dtype=torch.float32) * 3
    logits[5, 10:20] = logits[5, 9]  # ties at the top-k cut
    vals = lambda xs: torch.tensor(xs, device=DEVICE)  # noqa: E731
    temperature = vals([0.0 if i % 4 == 0 else 0.8 for i in range(64)]).float()
    top_k = vals([[0, 5, 15, 1][i % 4] for i in range(64)])
    top_p = vals([[0.0, 0.9, 0.5, 0.0][i % 4] for i in range(64)]).float()
    min_p = vals([[0.0, 0.0, 0.05, 0.1][i % 4] for i in range(64)]).float()
    seed = vals(list(range(100, 164)))
    position = vals([7 * i for i in range(64)])

    def run(lg, t, k, p, mp, s, pos):
        tokens = sampling.sample_reference(lg, sampling.RowParams(t, k, p, mp, s, pos), any_filter=True)
        cols = [tokens[:, None].float()]
        if DEVICE == "cuda":
            from megatron_async.kernels import triton_sampling

            fast = triton_sampling.sample(lg, t, k, p, mp, s, pos, True)
            cols.append(fast[:, None].float())
        lp, top_vals, ids = sampling.log_probs_of(lg, tokens, 3, batch_invariant=True)
        return torch.cat(cols + [lp[:, None], top_vals, ids.float()], -1)

    _assert_rows_invariant(run, logits, temperature, top_k, top_p, min_p, seed, position)


# ------------------------------------------------------------------ attention
H, KVH, D, BS = 2, 1, 16, 4  # GQA group 2 on one KV head (the interpreter pays per KV head; test_invariant_attention
# checks several against the reference); block size 4: chunks and tiles cross blocks


class _Paged:
    """One paged cache shared by a probe sequence and random filler rows."""

    def __init__(self, probe_len: int, seed: int):
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.rng = random.Random(seed)
        self.num_blocks = 1 + 64 * 8
        # NaN everywhere the probe has not written: a read of an unwritten slot poisons it
        self.cache = torch.full((2, self.num_blocks, BS, KVH, D), float("nan"), device=DEVICE, dtype=DTYPE)
        self.probe_blocks = list(range(1, 1 + -(-probe_len // BS)))
        self.next_block = self.probe_blocks[-1] + 1

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.gen, device=DEVICE).to(DTYPE)

    def filler(self) -> tuple[list[int], int, int]:
        """A random other row: (blocks, cached tokens, new tokens), its cached KV filled."""
        cached, new = self.rng.randint(0, 12), self.rng.choice([1, 1, 3])
        nb = -(-(cached + new) // BS)
        blocks = list(range(self.next_block, self.next_block + nb))
        self.next_block += nb
        self.cache[:, blocks] = self.rand(2, nb, BS, KVH, D)
        return blocks, cached, new


def _step(paged: _Paged, rows: list[tuple[list[int], int, int, torch.Tensor, torch.Tensor, torch.Tensor]]):
    """One attend call over rows (blocks, cached, new, q, k, v); returns the per-row outputs."""
    width = 64  # as wide as the engine's tables: the default decode kernel would split these rows
    table = torch.zeros(len(rows), width, dtype=torch.int32, device=DEVICE)
    pos, slots, t2r, cu = [], [], [], [0]
    for i, (blocks, cached, new, *_rest) in enumerate(rows):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        p = torch.arange(cached, cached + new, device=DEVICE)
        pos.append(p)
        slots.append(table[i].long()[p // BS] * BS + p % BS)
        t2r.append(torch.full((new,), i, dtype=torch.int32, device=DEVICE))
        cu.append(cu[-1] + new)
    meta = AttentionMetadata(
        num_tokens=cu[-1], num_rows=len(rows), max_query_len=max(r[2] for r in rows),
        max_kv_len=max(r[1] + r[2] for r in rows), is_decode_only=all(r[2] == 1 for r in rows),
        positions=torch.cat(pos), slot_mapping=torch.cat(slots), token_to_row=torch.cat(t2r),
        cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        kv_lens=torch.tensor([r[1] + r[2] for r in rows], dtype=torch.int32, device=DEVICE),
        block_table=table, block_size=BS,
    )
    q, k, v = (torch.cat([r[j] for r in rows]) for j in (3, 4, 5))
    out = attend(q, k, v, paged.cache, meta, D**-0.5, batch_invariant=True)
    return [out[cu[i]: cu[i + 1]] for i in range(len(rows))]


def _run_probe(q, k, v, chunks: list[int], num_fillers: int | list[int], seed: int) -> torch.Tensor:
    """The probe's attention outputs when its tokens arrive in ``chunks`` (1 = a decode
    step), each step shared with ``num_fillers`` random rows (per step where a list; the probe
    at a varying index)."""
    paged = _Paged(q.shape[0], seed)
    outs, start = [], 0
    per_step = num_fillers if isinstance(num_fillers, list) else [num_fillers] * len(chunks)
    for step, (n, fillers) in enumerate(zip(chunks, per_step, strict=True)):
        rows = []
        for _ in range(fillers):
            blocks, cached, new = paged.filler()
            rows.append((blocks, cached, new, paged.rand(new, H, D), paged.rand(new, KVH, D), paged.rand(new, KVH, D)))
        probe = (paged.probe_blocks, start, n, q[start:start + n], k[start:start + n], v[start:start + n])
        rows.insert(step % (fillers + 1), probe)
        outs.append(_step(paged, rows)[rows.index(probe)])
        start += n
    return torch.cat(outs)


def test_attention_same_bits_for_decode_prefill_and_any_chunking():
    L = 37
    g = torch.Generator(device=DEVICE).manual_seed(11)
    q, k, v = (torch.randn(L, h, D, generator=g, device=DEVICE).to(DTYPE) for h in (H, KVH, KVH))
    whole = _run_probe(q, k, v, [L], num_fillers=0, seed=1)
    assert not whole.isnan().any()
    schedules = [
        ([L], 6, 2),  # one chunk among other rows
        ([13, 16, 8], 0, 3),  # chunk boundaries inside blocks and query tiles
        ([5, 1, 1, 30], 6, 4),  # chunk, decode steps, chunk
        ([31] + [1] * 6, 0, 5),  # prefill then decode alone (batch 1), across a block and the CPU's 32-key split
        ([31] + [1] * 6, 6, 6),  # ... and decode in a batch of 7
    ]
    for chunks, fillers, seed in schedules:
        assert torch.equal(_run_probe(q, k, v, chunks, fillers, seed), whole), (chunks, fillers)
    # the last token, decoded in a batch of 64 (its prefill alone: the step in question is the decode)
    assert torch.equal(_run_probe(q, k, v, [L - 1, 1], [0, 63], 7)[-1], whole[-1])
