"""Triton paged attention vs the torch reference on tiny random problems (interpreter on
CPU, compiled on CUDA). See paged_attention_cases for how unused cache slots are poisoned."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.config import AttentionBackend  # noqa: E402
from megatron_async.kernels import attention, attention_torch, attention_triton  # noqa: E402
from megatron_async.kernels.triton_decode_attention import decode_attention  # noqa: E402
from megatron_async.kernels.triton_kv_append import append_kv  # noqa: E402
from megatron_async.kernels.triton_prefill_attention import prefill_attention  # noqa: E402

from tests.helpers.paged_attention_cases import PagedCase, make_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = dict(rtol=1e-4, atol=1e-5)
LOW_TOL = dict(rtol=2e-2, atol=2e-2)

# (cached, new): kv_len 1, lengths on and across block boundaries (block sizes 4/8/16).
DECODE_ROWS = [(0, 1), (3, 1), (4, 1), (7, 1), (16, 1), (40, 1)]
# Fresh prefills, chunks continuing a cached prefix at a nonzero position, a chunk longer
# than one query tile, and decode rows mixed in.
MIXED_ROWS = [(0, 7), (9, 6), (5, 1), (0, 1), (3, 21), (12, 1), (16, 3)]


def _case(rows: list[tuple[int, int]], group: int, head_dim: int, block_size: int, **kw) -> PagedCase:
    return make_case(rows, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     block_size=block_size, device=DEVICE, **kw)


def _check(case: PagedCase, tol: dict, meta=None) -> None:
    ref_out, ref_cache = case.reference()
    out = attention_triton.attend(case.q, case.k, case.v, case.kv_cache, meta or case.meta, case.scale)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    assert torch.equal(torch.nan_to_num(case.kv_cache, nan=0.0), ref_cache)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter is the CPU path")
def test_cpu_runs_triton_interpreter():
    from triton.runtime.interpreter import InterpretedFunction

    from megatron_async.kernels import triton_decode_attention, triton_prefill_attention

    assert isinstance(triton_prefill_attention._prefill_kernel, InterpretedFunction)
    assert isinstance(triton_decode_attention._decode_split_kernel, InterpretedFunction)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_append_kv_matches_reference(block_size):
    case = _case(MIXED_ROWS, group=2, head_dim=16, block_size=block_size)
    cache = torch.nan_to_num(case.kv_cache, nan=0.0)
    ref = cache.clone()
    attention_torch.write_kv(ref, case.k, case.v, case.meta.slot_mapping)
    append_kv(cache, case.k, case.v, case.meta.slot_mapping)
    assert torch.equal(cache, ref)


def test_append_kv_skips_negative_slots():
    case = _case([(0, 4)], group=1, head_dim=16, block_size=4)
    cache = torch.zeros_like(case.kv_cache)
    slots = case.meta.slot_mapping.clone()
    slots[1] = -1
    append_kv(cache, case.k, case.v, slots)
    assert torch.equal(cache[0].flatten(0, 1)[slots[[0, 2, 3]]], case.k[[0, 2, 3]])
    assert torch.count_nonzero(cache[0].flatten(0, 1)[case.meta.slot_mapping[1]]) == 0


@pytest.mark.parametrize(
    "block_size,group,head_dim",
    [(4, 1, 32), (8, 2, 16), (16, 4, 32), (4, 8, 16), (8, 3, 16), (4, 2, 8)],  # 8: padded to a 16-wide dot
)
def test_decode_matches_reference(block_size, group, head_dim):
    _check(_case(DECODE_ROWS, group, head_dim, block_size, seed=block_size + group), FP32_TOL)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_counts(num_splits):
    """Every split count merges to the same answer, including splits left empty."""
    case = _case(DECODE_ROWS, group=2, head_dim=16, block_size=4, seed=num_splits)
    ref_out, ref_cache = case.reference()
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    out = decode_attention(case.q, case.kv_cache, case.meta, case.scale, num_splits=num_splits)
    torch.testing.assert_close(out, ref_out, **FP32_TOL)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_row_order_changes_launch_order_only(num_splits):
    """With ``meta.row_order`` (any permutation: longest first, reversed), and with rows or KV
    heads fastest in the grid, every row gets the bits it gets in row order: the order only
    decides which programs start first."""
    from megatron_async.forward_batch import longest_first

    case = _case(DECODE_ROWS, group=2, head_dim=16, block_size=4, seed=5)
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    plain = decode_attention(case.q, case.kv_cache, case.meta, case.scale, num_splits=num_splits)
    lens = case.meta.kv_lens.tolist()
    for order in (longest_first(lens), list(reversed(range(len(lens))))):
        meta = dataclasses.replace(case.meta, row_order=torch.tensor(order, dtype=torch.int32, device=DEVICE))
        for heads_fastest in (True, False):
            out = decode_attention(case.q, case.kv_cache, meta, case.scale, num_splits=num_splits,
                                   heads_fastest=heads_fastest)
            assert torch.equal(out, plain)
    assert longest_first(lens).tolist() == sorted(range(len(lens)), key=lambda r: (-lens[r], r))


def test_decode_with_upper_bound_max_kv_len_replays():
    """CUDA-graph style: Python ints fixed at capture (max_kv_len = table capacity); the
    tensors are refilled in place with another step's data and the call is repeated."""
    width = 12  # blocks per row: capacity 48 tokens
    first = _case(DECODE_ROWS, group=2, head_dim=16, block_size=4, table_width=width, seed=1)
    captured = dataclasses.replace(first.meta, max_kv_len=width * 4)
    _check(first, FP32_TOL, meta=captured)

    second = _case([(46, 1), (0, 1), (8, 1), (30, 1), (2, 1), (19, 1)], group=2, head_dim=16,
                   block_size=4, table_width=width, seed=2)
    for name in ("positions", "slot_mapping", "kv_lens", "block_table"):
        getattr(captured, name).copy_(getattr(second.meta, name))
    replay = dataclasses.replace(second, meta=captured)
    _check(replay, FP32_TOL, meta=captured)


@pytest.mark.parametrize(
    "block_size,group,head_dim",
    [(4, 1, 32), (8, 2, 16), (16, 4, 32), (4, 8, 16), (8, 3, 16), (4, 2, 8)],  # 8: padded to a 16-wide dot
)
def test_mixed_matches_reference(block_size, group, head_dim):
    _check(_case(MIXED_ROWS, group, head_dim, block_size, seed=block_size * group), FP32_TOL)


def test_prefill_kernel_on_decode_rows_and_small_tiles():
    """The varlen kernel is exact for decode-only steps too, and with 1-token query tiles."""
    case = _case(DECODE_ROWS + MIXED_ROWS, group=2, head_dim=16, block_size=8, seed=5)
    ref_out, _ = case.reference()
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    out = prefill_attention(case.q, case.kv_cache, case.meta, case.scale, block_q=8, block_n=32)
    torch.testing.assert_close(out, ref_out, **FP32_TOL)


def test_decode_split_count_rule(monkeypatch):
    """Rows x KV heads within 10 % of two programs an SM keep one split; fewer split so their last
    wave comes within 5 % of the fullest (264 places on a 132-SM device) on the fewest splits,
    between the fewest that reach 90 % of one fill and twice the count that fills it once, capped
    at >= 128 keys a split."""
    from megatron_async.kernels import decode_splits as dec

    monkeypatch.setattr(dec, "num_compute_units", lambda device: 132)
    dev = torch.device(DEVICE)
    assert dec.choose_num_splits(32, 8, 128, 16, dev) == 1  # 256 programs: 0.97 of a fill
    assert dec.choose_num_splits(124, 2, 128, 16, dev) == 1  # 248: 0.94
    assert dec.choose_num_splits(16, 8, 128, 16, dev) == 2  # 256 programs in one wave, not 384 in two
    assert dec.choose_num_splits(20, 8, 128, 16, dev) == 3  # 480 of 528 places, not 320
    assert dec.choose_num_splits(24, 8, 128, 16, dev) == 4  # 768 of 792, not 384 of 528
    assert dec.choose_num_splits(12, 8, 2048, 16, dev) == 5  # 480 of 528
    assert dec.choose_num_splits(28, 8, 128, 16, dev) == 2  # every count from 2 to 4 fills 85 %: the fewest
    assert dec.choose_num_splits(8, 2, 1025, 16, dev) == 16  # 256 of 264: one wave, not two of 33 splits
    assert dec.choose_num_splits(1, 8, 1025, 16, dev) == 32  # 256 of 264
    assert dec.choose_num_splits(1, 8, 128, 16, dev) == 16  # capped: >= 128 keys per split of a 2,048-token row
    assert dec.choose_num_splits(1, 8, 8, 16, dev) == 1  # a 128-token table keeps one split
    # a long-tile step's decode rows: rows counted with the prompts' and padding, splits of <= 2,048 keys
    assert dec.mixed_step_splits(32, 8, 1032, 16, dev) == 9  # one split as a decode step of 32 rows
    assert dec.mixed_step_splits(4, 8, 1032, 16, dev) == 9
    assert dec.mixed_step_splits(16, 8, 128, 16, dev) == 2  # a short table: the decode step's count
    assert dec.mixed_step_splits(1, 8, 16384, 16, dev) == 64  # capped
    assert dec.mixed_step_splits(512, 8, 8192, 16, dev) == 4  # many rows: 2,048 row-splits bound the partials


def test_prefill_grid_order_changes_launch_order_only():
    """KV heads first (the default) or query tiles first in the varlen kernel's grid: same bits."""
    case = _case(MIXED_ROWS, group=2, head_dim=16, block_size=4, seed=7)
    ref_out, _ = case.reference()
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    heads_first = prefill_attention(case.q, case.kv_cache, case.meta, case.scale)
    tiles_first = prefill_attention(case.q, case.kv_cache, case.meta, case.scale, heads_fastest=False)
    assert torch.equal(heads_first, tiles_first)
    torch.testing.assert_close(heads_first, ref_out, **FP32_TOL)


def test_prefill_schedule_lists_every_tile_once_most_keys_first():
    """The step's tile schedule: each (row, first query) of every row's query tiles exactly once,
    by descending keys (the tile's last query position + 1), empty slots (-1) last."""
    from megatron_async.kernels.triton_prefill_attention import tile_schedule

    rows = DECODE_ROWS + MIXED_ROWS + [(0, 0), (30, 17)]  # a row with no query tokens too
    case = _case(rows, group=2, head_dim=16, block_size=4, seed=3)
    meta, block_q = case.meta, 4
    slots = meta.num_tokens // block_q + meta.num_rows
    entries = tile_schedule(meta, block_q, slots).tolist()
    assert tile_schedule(meta, block_q, slots) is tile_schedule(meta, block_q, slots)  # once per step
    live = [e for e in entries if e >= 0]
    assert entries[len(live):] == [-1] * (slots - len(live))
    want = {(r, q0): cached + min(q0 + block_q, new)
            for r, (cached, new) in enumerate(rows) for q0 in range(0, new, block_q)}
    got = [(e >> 32, e & 0x7FFFFFFF) for e in live]
    assert sorted(got) == sorted(want)
    keys = [want[t] for t in got]
    assert keys == sorted(keys, reverse=True)


def test_prefill_schedule_order_changes_no_bits():
    """Programs take tiles in the schedule's order: any order of the same tiles gives the same bits."""
    from megatron_async.kernels.triton_prefill_attention import tile_schedule

    case = _case(MIXED_ROWS, group=2, head_dim=16, block_size=4, seed=9)
    ref_out, _ = case.reference()
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    block_q = 8  # 16 matrix rows with the group of 2: the launch keeps it
    slots = case.meta.num_tokens // block_q + case.meta.num_rows
    out = prefill_attention(case.q, case.kv_cache, case.meta, case.scale, block_q=block_q)
    (key,) = case.meta.scratch
    assert key == ("prefill_schedule", block_q, slots, 0, 2**31 - 1)
    case.meta.scratch[key] = tile_schedule(case.meta, block_q, slots).flip(0)  # empty slots first, shortest tiles next
    flipped = prefill_attention(case.q, case.kv_cache, case.meta, case.scale, block_q=block_q)
    assert torch.equal(out, flipped)
    torch.testing.assert_close(out, ref_out, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [DECODE_ROWS, MIXED_ROWS], ids=["decode", "mixed"])
def test_low_precision(dtype, rows):
    _check(_case(rows, group=2, head_dim=32, block_size=8, dtype=dtype), LOW_TOL)


def test_backend_dispatch_runs_triton(monkeypatch):
    case = _case(MIXED_ROWS, group=2, head_dim=16, block_size=4, seed=9)
    ref_out, ref_cache = case.reference()

    def fail(*args, **kwargs):
        raise AssertionError("torch reference called under the triton backend")

    monkeypatch.setattr(attention_torch, "write_kv", fail)
    monkeypatch.setattr(attention_torch, "paged_attention", fail)
    out = attention.attend(case.q, case.k, case.v, case.kv_cache, case.meta, case.scale, backend=AttentionBackend.TRITON)
    torch.testing.assert_close(out, ref_out, **FP32_TOL)
    assert torch.equal(torch.nan_to_num(case.kv_cache, nan=0.0), ref_cache)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padding_row_is_zero(num_splits):
    """A CUDA-graph filler row (slot -1, kv_len 0) writes nothing and attends to nothing."""
    case = _case(DECODE_ROWS, group=2, head_dim=16, block_size=4, seed=11)
    ref_out, _ = case.reference()
    skipped_slot = case.meta.slot_mapping[-1].item()
    case.meta.slot_mapping[-1] = -1
    case.meta.kv_lens[-1] = 0
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    out = decode_attention(case.q, case.kv_cache, case.meta, case.scale, num_splits=num_splits)
    torch.testing.assert_close(out[:-1], ref_out[:-1], **FP32_TOL)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert torch.isnan(case.kv_cache.flatten(1, 2)[:, skipped_slot]).all()  # still the unused-slot poison


def _launch(rows: int, block_n: int, kernel: str, ws: bool = False):
    from megatron_async.kernels.triton_prefill_common import PrefillLaunch

    return PrefillLaunch(rows, block_n, 4, 2, 0, kernel, ws)


# (kernel, block_size, rows a tile, keys a tile, warp-specialized): tiles across pages (pointer reads), a tile
# a page, two tiles a page (the second at an offset inside it), 32-row tiles (two query tokens of a group of 16)
PREFILL_VARIANTS = [("pointer", 4, 16, 16, False), ("wide", 4, 16, 16, False), ("wide", 8, 32, 32, True),
                    ("tma", 16, 16, 16, False), ("tma", 32, 32, 16, True), ("tma", 8, 16, 8, False)]


@pytest.mark.parametrize("kernel,block_size,rows,block_n,ws", PREFILL_VARIANTS)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_variants_match_reference(kernel, block_size, rows, block_n, ws, group):
    """Every prefill kernel variant over fresh prompts, chunks continuing a cached prefix, a chunk
    longer than a tile and decode rows, each GQA group: the torch reference's answer, though unused
    slots of the rows' last pages hold NaN (a TMA tile reads them: V zeroed, scores masked)."""
    case = _case(DECODE_ROWS + MIXED_ROWS + [(37, 19)], group, head_dim=16, block_size=block_size,
                 seed=block_size * group + rows)
    ref_out, _ = case.reference()
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    out = prefill_attention(case.q, case.kv_cache, case.meta, case.scale, launch=_launch(rows, block_n, kernel, ws))
    torch.testing.assert_close(out, ref_out, **FP32_TOL)


@pytest.mark.parametrize("kernel,block_size", [("wide", 16), ("tma", 16)])
def test_prefill_wide_variants_low_precision(kernel, block_size):
    case = _case(MIXED_ROWS, group=2, head_dim=32, block_size=block_size, dtype=torch.bfloat16, seed=3)
    ref_out, _ = case.reference()
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    out = prefill_attention(case.q, case.kv_cache, case.meta, case.scale, launch=_launch(16, 16, kernel))
    torch.testing.assert_close(out.float(), ref_out.float(), **LOW_TOL)


def test_prefill_explicit_launch_its_kernel_cannot_run_is_refused(monkeypatch):
    """An explicit launch whose kernel cannot run the call raises; a default one falls back to the
    pointer kernel (pages smaller than its TMA tile, a head_dim not a power of two) and is still right."""
    from megatron_async.kernels import triton_prefill_attention as pa

    case = _case(MIXED_ROWS, group=2, head_dim=16, block_size=4, seed=13)
    ref_out, _ = case.reference()
    append_kv(case.kv_cache, case.k, case.v, case.meta.slot_mapping)
    with pytest.raises(ValueError, match="pages of at least"):
        prefill_attention(case.q, case.kv_cache, case.meta, case.scale, launch=_launch(16, 16, "tma"))
    with pytest.raises(ValueError, match="unknown prefill kernel"):
        prefill_attention(case.q, case.kv_cache, case.meta, case.scale, launch=_launch(16, 16, "tiled"))
    tma = _launch(16, 16, "tma")
    monkeypatch.setattr(pa, "prefill_launch", lambda *args: tma)
    ran = []
    monkeypatch.setattr(pa, "fitted_launch", lambda launch, *args: ran.append(launch) or launch)
    out = prefill_attention(case.q, case.kv_cache, case.meta, case.scale)
    assert ran[0].kernel == "pointer"
    torch.testing.assert_close(out, ref_out, **FP32_TOL)
    odd = _case(MIXED_ROWS, group=2, head_dim=24, block_size=16, seed=14)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        prefill_attention(odd.q, odd.kv_cache, odd.meta, odd.scale, launch=_launch(16, 16, "wide"))
