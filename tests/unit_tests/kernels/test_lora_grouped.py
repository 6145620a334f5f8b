"""The LoRA op over rows grouped by slot (``lora_groups`` + ``triton_lora_grouped``, interpreted
here): the grouping's order / starts / tile table are what they claim, the grouped op equals the
torch reference and the ungrouped op for mixed slots, rows of slot -1, one slot, no adapter, T
not a multiple of the tile and more slots than tiles would hold alone, and a row's bits do not
depend on the rows beside it (batch-invariant mode)."""
import pytest
import torch

from megatron_async.kernels.lora_groups import group_lora_rows, max_tiles
from megatron_async.kernels.lora_ops import lora_add, lora_add_reference
from megatron_async.kernels.triton_lora import lora_add_triton
from megatron_async.kernels.triton_lora_grouped import GROUPED_DECODE_ROWS, grouped_tiles, lora_add_grouped


def _case(T, K=40, slices=((0, 24), (24, 32), (32, 40)), L=3, R=8, seed=0, dtype=torch.float32, slots=None):
    g = torch.Generator().manual_seed(seed)
    S, N = len(slices), slices[-1][1]
    x = torch.randn(T, K, generator=g).to(dtype)
    a = torch.randn(L, S * R, K, generator=g).to(dtype)
    b = torch.randn(L, N, R, generator=g).to(dtype)
    scale = torch.rand(L, S, generator=g)
    if slots is None:
        slots = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32)
    y = torch.randn(T, N, generator=g).to(dtype)
    starts = torch.tensor([s for s, _ in slices] + [N], dtype=torch.int32)
    return y, x, a, b, scale, slots, starts, slices


def _check_groups(slots: torch.Tensor, L: int, batch_invariant: bool = False):
    groups = group_lora_rows(slots, L, batch_invariant)
    T, bm = slots.shape[0], groups.block_m
    key = torch.where(slots >= 0, slots, L)
    assert sorted(groups.order.tolist()) == list(range(T))
    assert torch.equal(key[groups.order.long()], key.sort(stable=True).values)
    assert torch.equal(groups.order.long(), key.sort(stable=True).indices)  # stable: earlier rows first
    counts = torch.bincount(key.long(), minlength=L + 1)
    assert groups.slot_starts.tolist() == [0] + counts.cumsum(0).tolist()
    assert groups.tiles.shape == (max_tiles(T, L, bm), 3)
    covered = []
    for lora, first, rows in groups.tiles.tolist():
        if rows == 0:
            assert (lora, first) == (-1, 0)
            continue
        assert 0 <= lora < L and 0 < rows <= bm
        members = groups.order[first:first + rows].long()
        assert bool((slots[members] == lora).all())
        covered += members.tolist()
    assert sorted(covered) == sorted(torch.nonzero(slots >= 0).squeeze(1).tolist())  # each adapter row once
    return groups


@pytest.mark.parametrize("name,T,slots", [
    ("mixed", 23, None),
    ("round_robin_with_base", 40, torch.arange(40, dtype=torch.int32) % 4 - 1),
    ("one_slot", 37, torch.full((37,), 2, dtype=torch.int32)),
    ("all_base", 21, torch.full((21,), -1, dtype=torch.int32)),
    ("one_row", 1, torch.tensor([1], dtype=torch.int32)),
    ("tile_plus_one", 17, torch.tensor([0] * 17, dtype=torch.int32)),
])
def test_grouped_equals_reference_and_ungrouped(name, T, slots):
    y, x, a, b, scale, slots, starts, slices = _case(T, slots=slots)
    groups = _check_groups(slots, a.shape[0])
    ref, old, new = y.clone(), y.clone(), y.clone()
    lora_add_reference(ref, x, a, b, scale, slots, slices)
    lora_add_triton(old, x, a, b, scale, slots, starts, tiles=grouped_tiles(T, False))
    lora_add_grouped(new, x, a, b, scale, groups, starts)
    torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(new, old)  # the same per-row arithmetic as the ungrouped op at the same tiles
    base = slots < 0
    assert torch.equal(new[base], y[base])  # rows of slot -1: untouched, bit for bit


def test_more_slots_than_tiles():
    """12 slots over 20 rows (one tile's worth): a tile per slot, many of one row; K of 600 gives
    three splits (the last 88 wide) and a bf16 pass checks the model-dtype roundings."""
    for dtype in (torch.float32, torch.bfloat16):
        slots = torch.arange(20, dtype=torch.int32) % 13 - 1
        y, x, a, b, scale, slots, starts, slices = _case(20, K=600, L=12, seed=5, dtype=dtype, slots=slots)
        groups = _check_groups(slots, 12)
        assert int((groups.tiles[:, 2] > 0).sum()) == 12 > (20 + groups.block_m - 1) // groups.block_m
        old, new = y.clone(), y.clone()
        lora_add_triton(old, x, a, b, scale, slots, starts, tiles=grouped_tiles(20, False))
        lora_add_grouped(new, x, a, b, scale, groups, starts)
        assert torch.equal(new, old)
        if dtype == torch.float32:
            ref = y.clone()
            lora_add_reference(ref, x, a, b, scale, slots, slices)
            torch.testing.assert_close(new, ref, rtol=1e-4, atol=1e-4)


def test_prefill_tiles_grouping():
    """Above ``GROUPED_DECODE_ROWS`` rows the 64-row tiles: the table still covers every row once."""
    T = GROUPED_DECODE_ROWS + 3
    slots = torch.randint(-1, 5, (T,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    assert _check_groups(slots, 5).block_m == 64
    assert _check_groups(slots, 5, batch_invariant=True).block_m == 16


def test_dispatch_batch_invariant_across_batches():
    """``lora_add`` with groups, batch-invariant mode: a row's bits equal those of the row alone,
    among a few rows and in a shuffled batch, float32 and bfloat16."""
    for dtype in (torch.float32, torch.bfloat16):
        y, x, a, b, scale, slots, starts, slices = _case(37, K=600, L=6, seed=11, dtype=dtype)

        def run(rows):
            out = y[rows].clone()
            s = slots[rows].contiguous()
            lora_add(out, x[rows], a, b, scale, s, starts, slices, True, group_lora_rows(s, 6, True))
            return out

        whole = run(torch.arange(37))
        perm = torch.randperm(37, generator=torch.Generator().manual_seed(1))
        assert torch.equal(run(perm), whole[perm])
        for rows in ([3], [20, 21, 22, 30]):
            assert torch.equal(run(torch.tensor(rows)), whole[rows])
        plain = y.clone()
        lora_add(plain, x, a, b, scale, slots, starts, slices, True)
        assert torch.equal(whole, plain)


def test_groups_of_other_rows_refused():
    y, x, a, b, scale, slots, starts, slices = _case(10)
    with pytest.raises(ValueError, match="do not fit"):
        lora_add_grouped(y, x, a, b, scale, group_lora_rows(slots[:9], 3, False), starts)
