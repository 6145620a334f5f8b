"""A long-tile step's long rows on FlashInfer's FA3 kernel (``flashinfer_prefill``), its one-token
rows on the decode kernel, the others on the Triton prefill kernel. Everywhere (interpreted on
CPU): the work lists written on the device hold every (query head, row, query tile) of the
rows of 128+ tokens exactly once, dealt evenly in snake order; the kernels' tile schedules split
the step's rows; the decode rows' outputs equal the reference and leave the others; the start-up
check turns a wrong kernel away. On an H100 / H200 with ``flashinfer`` importable: the split
step's outputs against a float32 reference at real shapes (a fresh 8k prompt, prompts beside
decode rows, a chunk after a cached prefix, rows of 127 / 128 tokens; head_dim 64, 128 and 256),
in a CUDA graph the same bits as eager, and the start-up check passes at each head_dim."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import flashinfer_prefill  # noqa: E402
from megatron_async.kernels.triton_prefill_attention import prefill_attention  # noqa: E402
from megatron_async.kernels.triton_tile_schedule import tile_schedule  # noqa: E402
from tests.helpers.paged_attention_cases import make_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (cached, new): long rows of one, three and eight tiles (one ending mid-tile), a row of exactly
# 128, rows just below (127) and far below (decode rows, an empty row).
ROWS = [(0, 300), (7, 1), (50, 128), (10, 127), (0, 0), (200, 1000), (33, 1)]


def _lists(rows, heads: int, programs: int, size: int):
    case = make_case(rows, num_heads=heads, num_kv_heads=2, head_dim=16, block_size=16, device=DEVICE, seed=1)
    ws, plan_info = flashinfer_prefill.work_lists(case.meta, heads, programs, size)
    assert flashinfer_prefill.work_lists(case.meta, heads, programs, size)[0] is ws  # once per step
    assert plan_info[-1] == 0 and all(off % 16 == 0 for off in plan_info[:-1])  # a schedule per head, aligned
    ws = ws.cpu()
    tile, qo, page, qo_len, kv_len, head, indptr, row = (ws[off // 4:] for off in plan_info[:-1])
    return case, tile, qo, page, qo_len, kv_len, head, indptr[: programs + 1].tolist(), row


@pytest.mark.parametrize("heads,programs,head_dim", [(4, 7, 128), (2, 5, 128), (4, 48, 64), (4, 200, 256)])
def test_work_lists_hold_every_long_tile_once_dealt_evenly(heads, programs, head_dim):
    size = flashinfer_prefill.tile_q(head_dim)  # 192 at head_dim 64: the lists count in the kernel's tiles
    case, tile, qo, page, qo_len, kv_len, head, indptr, row = _lists(ROWS, heads, programs, size)
    cu = case.meta.cu_query_lens.tolist()
    stride = case.meta.block_table.stride(0)
    want = {(h, r, t) for r, (_, new) in enumerate(ROWS) if new >= flashinfer_prefill.MIN_QUERY
            for t in range(-(-new // size)) for h in range(heads)}
    n = len(want)
    assert indptr[0] == 0 and indptr[-1] == n and all(a <= b for a, b in zip(indptr, indptr[1:]))
    counts = [b - a for a, b in zip(indptr, indptr[1:])]
    assert max(counts) - min(counts) <= 1  # one item a program a round
    got = []
    for c in range(programs):
        keys = []
        for i in range(indptr[c], indptr[c + 1]):
            r = int(row[i])
            cached, new = ROWS[r]
            assert (qo[i], page[i], qo_len[i], kv_len[i]) == (cu[r], r * stride, new, cached + new)
            got.append((int(head[i]), r, int(tile[i])))
            keys.append(cached + min((int(tile[i]) + 1) * size, new))
        assert keys == sorted(keys, reverse=True)  # a program's items in rounds: most keys first
    assert sorted(got) == sorted(want) and len(got) == n


def test_the_schedules_split_the_rows():
    """The FA3 rows (``MIN_QUERY``+ tokens), the Triton prefill kernel's (2 to ``MIN_QUERY`` - 1) and
    the one-token rows (the decode kernel's) make the whole schedule."""
    case = make_case(ROWS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, device=DEVICE, seed=1)
    meta, block_q = case.meta, 32
    slots = meta.num_tokens // block_q + meta.num_rows

    def live(**kw):
        return {e for e in tile_schedule(meta, block_q, slots, **kw).tolist() if e >= 0}

    long_rows = live(min_query=flashinfer_prefill.MIN_QUERY)
    short_rows = live(min_query=2, max_query=flashinfer_prefill.MIN_QUERY - 1)
    one_token = live(max_query=1)
    assert long_rows and short_rows and one_token
    assert not long_rows & short_rows and not (long_rows | short_rows) & one_token
    assert long_rows | short_rows | one_token == live()
    assert {e >> 32 for e in long_rows} == {0, 2, 5} and {e >> 32 for e in short_rows} == {3}


@pytest.mark.parametrize("split_keys", [None, 32])
def test_decode_rows_on_the_decode_kernel_leave_the_others(monkeypatch, split_keys):
    """``attend_decode_rows``: each one-token row's output against the reference (fresh random
    inputs, every other row's output left as it was: an empty row, prompt rows, long rows), with
    the step's split count, and with splits of 32 keys (``mixed_step_splits``' floor lowered)."""
    from megatron_async.kernels import decode_splits
    from megatron_async.kernels.triton_kv_append import append_kv

    if split_keys:
        monkeypatch.setattr(decode_splits, "MIXED_SPLIT_KEYS", split_keys)
    case = make_case(ROWS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, device=DEVICE, seed=11)
    ref, _ = case.reference()
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    if split_keys:
        table = case.meta.block_table.shape[1] * 16
        assert decode_splits.mixed_step_splits(case.meta.num_rows, 2, table // 16, 16, case.q.device) >= table // 32 > 1
    out = torch.full_like(case.q, 7.0)
    flashinfer_prefill.attend_decode_rows(case.q, case.kv_cache, case.meta, case.scale, out)
    view = case.meta.scratch["fa3_decode_view"]
    flashinfer_prefill.attend_decode_rows(case.q, case.kv_cache, case.meta, case.scale, out)  # the next layer
    assert case.meta.scratch["fa3_decode_view"] is view  # built once a step
    cu = case.meta.cu_query_lens.tolist()
    for r, (_, new) in enumerate(ROWS):
        got = out[cu[r]:cu[r + 1]]
        if new == 1:
            torch.testing.assert_close(got, ref[cu[r]:cu[r + 1]], rtol=1e-4, atol=1e-5)
        else:
            assert torch.all(got == 7.0)


needs_fa3 = pytest.mark.skipif(
    DEVICE != "cuda" or flashinfer_prefill.unusable(torch.device("cuda"), torch.bfloat16, 128) is not None,
    reason="FlashInfer's FA3 kernel: an H100 / H200 with flashinfer importable")


def _reference(case) -> torch.Tensor:
    from benchmarks.kernel_times.prefill_attention import reference

    return reference(case)


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("rows", [
    [(0, 8192)],
    [(0, 1024)] * 4 + [(700, 1), (1500, 1), (2047, 1)],
    [(4096, 2048), (9000, 1), (0, 127), (0, 128)],
], ids=["8k", "prompts+decode", "after-prefix"])
@pytest.mark.parametrize("heads,head_dim", [((16, 8), 128), ((32, 8), 128), ((16, 8), 64), ((16, 8), 256)])
def test_split_step_matches_the_reference(rows, heads, head_dim):
    case = make_case(rows, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=16,
                     dtype=torch.bfloat16, device="cuda", seed=7)
    from megatron_async.kernels.triton_kv_append import append_kv

    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    case.kv_cache.nan_to_num_(0.0)  # a row's last page past its keys: read, weighted zero
    meta = dataclasses.replace(case.meta, long_tiles=True)
    ref = _reference(dataclasses.replace(case, meta=meta))

    def run():
        return prefill_attention(case.q, case.kv_cache, meta, case.scale, flashinfer_rows=True)

    out = run()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    assert ("fa3_lists", heads[0], programs, flashinfer_prefill.tile_q(head_dim)) in meta.scratch
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        again = run()
    graph.replay()
    assert torch.equal(again, out)


@pytest.mark.parametrize("wrong", [False, True])
def test_start_up_check_keeps_a_wrong_kernel_off(monkeypatch, caplog, wrong):
    """``ready``: the start-up check against a float32 attention passes a right kernel and turns a
    wrong one (here: keys one position short, as work lists read otherwise could make it) away
    with a warning. The kernel stood in by the torch reference, on CPU."""
    from megatron_async.kernels import attention_torch

    def stand_in(q, kv_cache, meta, scale, out):
        if wrong:
            meta = dataclasses.replace(meta, kv_lens=meta.kv_lens - 1, positions=meta.positions - 1)
        out.copy_(attention_torch.paged_attention(q, kv_cache, meta, scale))

    monkeypatch.setattr(flashinfer_prefill, "attend_long_rows", stand_in)
    monkeypatch.setattr(flashinfer_prefill, "unusable", lambda *a: None)
    error = flashinfer_prefill.self_check(torch.device("cpu"), torch.float32, 128)
    assert (error > flashinfer_prefill.CHECK_TOLERANCE) if wrong else (error < 1e-4)
    with caplog.at_level("WARNING"):
        assert flashinfer_prefill.ready(torch.device("cpu"), torch.float32, 128) is not wrong
    assert ("off by" in caplog.text) is wrong


def test_not_ready_without_an_sm90_device():
    assert not flashinfer_prefill.ready(torch.device("cpu"), torch.bfloat16, 128)


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("head_dim", flashinfer_prefill.HEAD_DIMS)
def test_start_up_check_passes_the_installed_flashinfer(head_dim):
    error = flashinfer_prefill.self_check(torch.device("cuda"), torch.bfloat16, head_dim)
    assert error < flashinfer_prefill.CHECK_TOLERANCE
    assert flashinfer_prefill.ready(torch.device("cuda"), torch.bfloat16, head_dim)
