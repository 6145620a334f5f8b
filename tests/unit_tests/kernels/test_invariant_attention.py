"""The batch-invariant attention kernel (triton_invariant_attention): against the torch reference
with rows crossing split boundaries, and the same query's bits whether it is decoded alone, among
other rows, or as the last token of a prefill chunk of any length next to other rows. Tiny shapes
on CPU (interpreter), the Qwen3-0.6B attention shape with rows up to 16k keys on CUDA (``gpu``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.forward_batch import AttentionMetadata  # noqa: E402
from megatron_async.kernels import attention_torch, attention_triton  # noqa: E402
from megatron_async.kernels.triton_invariant_attention import (  # noqa: E402
    invariant_attention, launches, split_size, splits_long_steps, tiles,
)

from tests.helpers.paged_attention_cases import QWEN3_06B_HEADS, make_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows, dtype=torch.float32, device=DEVICE, seed=0, rows_per_reference=None, **shape):
    case = make_case(rows, dtype=dtype, device=device, seed=seed, **shape)
    ref_out = case.reference()[0] if rows_per_reference is None else _reference_in_parts(case, rows_per_reference)
    out = attention_triton.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale, fixed_order=True)
    return case, out, ref_out


def _meta(case, picks: list[tuple[int, int]]) -> AttentionMetadata:
    """A step over rows of ``case`` (its cache already holds their K/V): (row, queries), each row's
    last ``queries`` positions."""
    m, dev = case.meta, case.q.device
    kv = m.kv_lens.tolist()
    pos = [torch.arange(kv[r] - n, kv[r], device=dev) for r, n in picks]
    cu = torch.tensor([0] + [n for _, n in picks], device=dev).cumsum(0).to(torch.int32)
    rows = torch.tensor([r for r, _ in picks], device=dev)
    return AttentionMetadata(
        num_tokens=int(cu[-1]), num_rows=len(picks), max_query_len=max(n for _, n in picks),
        max_kv_len=max(kv[r] for r, _ in picks), is_decode_only=all(n == 1 for _, n in picks),
        positions=torch.cat(pos), slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64, device=dev),
        token_to_row=torch.repeat_interleave(torch.arange(len(picks), device=dev, dtype=torch.int32),
                                             torch.tensor([n for _, n in picks], device=dev)),
        cu_query_lens=cu, kv_lens=m.kv_lens[rows], block_table=m.block_table[rows].contiguous(),
        block_size=m.block_size)


def _reference_in_parts(case, rows_per_call: int) -> torch.Tensor:
    """The torch reference a few rows at a time: it pads every row to the longest query and key
    count of its call, which for 66 rows of up to 16k keys at once would be ~45 GiB."""
    cache = torch.nan_to_num(case.kv_cache, nan=0.0)
    attention_torch.write_kv(cache, case.k, case.v, case.meta.slot_mapping[: case.meta.num_tokens])
    cu = case.meta.cu_query_lens.tolist()
    parts = []
    for lo in range(0, case.meta.num_rows, rows_per_call):
        hi = min(lo + rows_per_call, case.meta.num_rows)
        meta = _meta(case, [(r, cu[r + 1] - cu[r]) for r in range(lo, hi)])
        parts.append(attention_torch.paged_attention(case.q[cu[lo]:cu[hi]], cache, meta, case.scale))
    return torch.cat(parts)


def _last_query_of(case, picks, probe_q, split=None, long_tiles=False) -> list[torch.Tensor]:
    """Outputs of every row's last query in a step over ``picks`` whose last queries are ``probe_q``
    [rows, H, D] (earlier queries of a row: random); ``long_tiles``: a long-tile step (its long rows
    in a launch of larger tiles)."""
    meta = dataclasses.replace(_meta(case, picks), long_tiles=long_tiles)
    g = torch.Generator(device=case.q.device).manual_seed(len(picks))
    q = torch.randn(meta.num_tokens, *probe_q.shape[1:], generator=g, device=case.q.device).to(probe_q.dtype)
    last = (meta.cu_query_lens[1:] - 1).long()
    q[last] = probe_q
    out = invariant_attention(q, case.kv_cache, meta, case.scale, split=split)
    return out[last]


def _check_invariance(case, probes: list[int], fillers: list[int], chunk: int, split=None) -> None:
    """Each probe row's last query: alone (a decode step of one row), in a decode step with the
    fillers, and closing a ``chunk``-token prefill chunk beside the fillers' decode rows and a
    chunk of another row, all bit-identical."""
    g = torch.Generator(device=case.q.device).manual_seed(7)
    H, D = case.q.shape[1:]
    probe_q = torch.randn(len(probes), H, D, generator=g, device=case.q.device).to(case.q.dtype)
    alone = torch.stack([_last_query_of(case, [(r, 1)], probe_q[i:i + 1], split)[0] for i, r in enumerate(probes)])
    assert not alone.isnan().any()
    picks = [(f, 1) for f in fillers] + [(r, 1) for r in probes]
    qs = torch.cat([torch.randn(len(fillers), H, D, generator=g, device=case.q.device).to(case.q.dtype), probe_q])
    batch = _last_query_of(case, picks, qs, split)[len(fillers):]
    assert torch.equal(batch, alone), "decode among other rows changed a row's bits"
    for i, r in enumerate(probes):
        picks = [(fillers[0], min(chunk // 2 + 1, int(case.meta.kv_lens[fillers[0]])))] + [(f, 1) for f in fillers[1:]]
        picks.append((r, chunk))
        qs = torch.cat([torch.randn(len(picks) - 1, H, D, generator=g, device=case.q.device).to(case.q.dtype),
                        probe_q[i:i + 1]])
        for long_tiles in (False, True):
            assert torch.equal(_last_query_of(case, picks, qs, split, long_tiles)[-1], alone[i]), \
                f"row {r} in a {chunk}-token chunk, long tiles {long_tiles}"


# (cached, new): decode rows around split boundaries (32 keys on CPU), chunks crossing them,
# a chunk longer than one query tile (4 sub-tiles x 8 tokens at group 2), kv_len 1.
ROWS = [(0, 1), (31, 1), (32, 1), (70, 1), (120, 1), (20, 30), (0, 45), (64, 1), (90, 40), (3, 5)]


@pytest.mark.skipif(DEVICE == "cuda", reason="32-key splits exist only in the interpreter; on CUDA the "
                    "long-row test below crosses 4,096-key splits")
@pytest.mark.parametrize("group,head_dim,block_size", [(2, 16, 4), (1, 32, 16), (4, 24, 8), (3, 16, 4)])
def test_matches_reference_across_splits(group, head_dim, block_size):
    case, out, ref = _case(ROWS, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                           table_width=256 // block_size, seed=group)
    max_keys = case.meta.block_table.shape[1] * block_size
    assert max(case.meta.kv_lens.tolist()) > 3 * split_size(max_keys, case.q.device)  # several splits merged
    tol = dict(rtol=1e-4, atol=1e-5) if case.q.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    long_meta = dataclasses.replace(case.meta, long_tiles=True)  # the chunks' rows in larger tiles, a launch apart
    assert len(launches(long_meta, group, 16, head_dim, case.q.device)) == 2
    assert torch.equal(invariant_attention(case.q, case.kv_cache, long_meta, case.scale), out)
    if group == 2:  # tiles on the grid's first axis (past 65,535 tiles): the same bits
        flipped = invariant_attention(case.q, case.kv_cache, case.meta, case.scale, heads_fastest=False)
        assert torch.equal(flipped, out)


def test_key_tile_and_long_steps_are_fixed_by_the_table():
    """32-key tiles and one launch in the default 4,096-key table; 64-key tiles, and long-tile steps
    split in two launches, from 8,192 keys (long-context engines)."""
    cuda = torch.device("cuda")
    assert [tiles(2, cuda, keys)[1] for keys in (4096, 8191, 8192, 16500)] == [32, 32, 64, 64]
    assert [splits_long_steps(cuda, keys) for keys in (4096, 16500)] == [False, True]


def test_split_size_is_fixed_by_the_table():
    assert split_size(16500, torch.device("cuda")) == 4096
    assert split_size(32768, torch.device("cuda")) == 4096
    assert split_size(131072, torch.device("cuda")) == 16384
    assert split_size(256, torch.device("cpu")) == 32


@pytest.mark.parametrize("split", [None, "small"])
def test_query_bits_independent_of_step(split):
    if split == "small":  # rows of up to 130 keys cross several splits (a multiple of the key tile)
        split = 64 if DEVICE == "cuda" else 16
    rows = [(c - 1, 1) for c in (130, 97, 64, 33, 20, 5, 47)]
    # GQA group 2 on one KV head: the interpreter pays per KV head (several: the reference test above)
    case, _, _ = _case(rows, num_heads=2, num_kv_heads=1, head_dim=16, block_size=4, table_width=64)
    _check_invariance(case, probes=[0, 1, 2, 3], fillers=[4, 5, 6], chunk=37, split=split)


# ------------------------------------------------------------------ real shapes (GPU)
LONG = [4095, 4096, 4097, 8193, 12000, 16384]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_long_rows_match_reference_and_keep_their_bits(block_size):
    """The 0.6B shape in bf16, a 16,500-key table (4,096-key splits, up to 5): decode rows of
    1-16k keys next to prefill chunks against the fp32 torch reference, then each long row's last
    query alone, in a 64-row decode step and closing 1-, 300- and 2,000-token chunks: same bits."""
    gen = torch.Generator().manual_seed(block_size)
    short = [(n - 1, 1) for n in torch.randint(1, 3000, (58,), generator=gen).tolist()]
    rows = [(n - 1, 1) for n in LONG] + short + [(0, 700), (5000, 300)]
    width = -(-16500 // block_size)
    case, out, ref = _case(rows, dtype=torch.bfloat16, device="cuda", table_width=width, block_size=block_size,
                           rows_per_reference=4, **QWEN3_06B_HEADS)
    assert split_size(width * block_size, out.device) == 4096
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-2)
    for chunk in (1, 300, 2000):
        _check_invariance(case, probes=list(range(len(LONG))), fillers=list(range(len(LONG), len(rows) - 2)),
                          chunk=chunk)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_step_replays_its_eager_bits():
    """A decode step of 32 rows of 8-16k keys captured in a CUDA graph gives the eager call's bits."""
    gen = torch.Generator().manual_seed(3)
    rows = [(n - 1, 1) for n in torch.randint(8000, 16001, (32,), generator=gen).tolist()]
    case, eager, _ = _case(rows, dtype=torch.bfloat16, device="cuda", table_width=16500 // 16 + 1, block_size=16,
                           **QWEN3_06B_HEADS)
    invariant_attention(case.q, case.kv_cache, case.meta, case.scale)  # warm (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = invariant_attention(case.q, case.kv_cache, case.meta, case.scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
