"""The batched LoRA op: the Triton split-K shrink / expand pair (interpreted here) equals the torch
reference and a per-row loop at every tile setting, rows of slot -1 stay as they are, and a row's
result does not depend on the rows around it or on the batch size (batch-invariant mode)."""
import pytest
import torch

from megatron_async.kernels.lora_ops import lora_add, lora_add_reference
from megatron_async.kernels.triton_lora import (DECODE_TILES, PREFILL_ROWS, PREFILL_TILES, LoRATiles,
                                                 lora_add_triton, lora_tiles)


def _case(T=23, K=40, slices=((0, 24), (24, 32), (32, 40)), L=3, R=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    S, N = len(slices), slices[-1][1]
    x = torch.randn(T, K, generator=g).to(dtype)
    a = torch.randn(L, S * R, K, generator=g).to(dtype)
    b = torch.randn(L, N, R, generator=g).to(dtype)
    a[1, R - 3:R] = 0  # slot 1 of rank 5 in its first slice: zero-padded rows
    scale = torch.rand(L, S, generator=g)
    slots = torch.randint(-1, L, (T + 5,), generator=g, dtype=torch.int32)
    y = torch.randn(T, N, generator=g).to(dtype)
    starts = torch.tensor([s for s, _ in slices] + [N], dtype=torch.int32)
    return y, x, a, b, scale, slots, starts, slices


def _per_row(y, x, a, b, scale, slots, slices):
    out = y.clone()
    R = b.shape[2]
    for t in range(x.shape[0]):
        lora = int(slots[t])
        if lora < 0:
            continue
        s = x[t] @ a[lora].T
        for j, (lo, hi) in enumerate(slices):
            out[t, lo:hi] += (s[j * R:(j + 1) * R] @ b[lora, lo:hi].T) * scale[lora, j]
    return out


@pytest.mark.parametrize("T", [1, 5, 23, 40])
def test_triton_equals_reference(T):
    y, x, a, b, scale, slots, starts, slices = _case(T=T)
    ref, got = y.clone(), y.clone()
    lora_add_reference(ref, x, a, b, scale, slots, slices)
    lora_add_triton(got, x, a, b, scale, slots, starts)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref, _per_row(y, x, a, b, scale, slots, slices), rtol=1e-5, atol=1e-5)
    base = slots[:T] < 0
    assert torch.equal(got[base], y[base])  # slot -1 rows: untouched, bit for bit


def test_dispatch_batch_invariant_rows_alone():
    """Batch-invariant mode (the Triton pair): each row's bits equal those of the row alone."""
    y, x, a, b, scale, slots, starts, slices = _case(T=19, seed=3)
    whole = y.clone()
    lora_add(whole, x, a, b, scale, slots, starts, slices, batch_invariant=True)
    for t in (0, 7, 18):
        alone = y[t:t + 1].clone()
        lora_add(alone, x[t:t + 1], a, b, scale, slots[t:t + 1], starts, slices, batch_invariant=True)
        assert torch.equal(alone[0], whole[t])


def test_bfloat16_close_to_float32():
    y, x, a, b, scale, slots, starts, slices = _case(T=9, seed=5)
    ref = y.clone()
    lora_add_reference(ref, x, a, b, scale, slots, slices)
    got = y.bfloat16()
    lora_add_triton(got, x.bfloat16(), a.bfloat16(), b.bfloat16(), scale, slots, starts)
    torch.testing.assert_close(got.float(), ref, rtol=5e-2, atol=2e-1)


SPLIT_TILES = LoRATiles(block_m=16, k_chunk=64, block_k=32, block_n=32, slot_programs=4)  # small K, several splits


@pytest.mark.parametrize("R", [1, 8, 16])
def test_split_k_equals_reference(R):
    """K = 200 in splits of 64 (the last 8 wide), slices 24 / 8 / 40 wide (column blocks of 32 cross
    their bounds), 11 slots (more than a tile's slot programs) mixed with rows of slot -1."""
    slices = ((0, 24), (24, 32), (32, 72))
    y, x, a, b, scale, slots, starts, _ = _case(T=40, K=200, slices=slices, L=11, R=R, seed=R)
    x *= 0.1
    slots[:16] = torch.tensor([10, -1, 0, 9, 1, 8, 2, 7, -1, 3, 6, 4, 5, 10, 0, -1])  # 11 slots in the first tile
    ref, got = y.clone(), y.clone()
    lora_add_reference(ref, x, a, b, scale, slots, slices)
    lora_add_triton(got, x, a, b, scale, slots, starts, tiles=SPLIT_TILES)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ref, _per_row(y, x, a, b, scale, slots, slices), rtol=1e-5, atol=1e-4)
    assert len(set(slots[:16].tolist()) - {-1}) > 2 * SPLIT_TILES.slot_programs  # 3 slots for some programs
    base = slots[:40] < 0
    assert base.any() and torch.equal(got[base], y[base])


@pytest.mark.parametrize("tiles", [DECODE_TILES, PREFILL_TILES, LoRATiles(32, 128, 128, 64, 1)])
def test_tile_settings_equal_reference(tiles):
    y, x, a, b, scale, slots, starts, slices = _case(T=70, K=1100, L=4, seed=7)
    x *= 0.1
    ref, got = y.clone(), y.clone()
    lora_add_reference(ref, x, a, b, scale, slots, slices)
    lora_add_triton(got, x, a, b, scale, slots, starts, tiles=tiles)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


def test_no_adapter_rows_leave_y_alone():
    y, x, a, b, scale, slots, starts, slices = _case(T=20, K=130)
    got = y.clone()
    lora_add_triton(got, x, a, b, scale, torch.full_like(slots, -1), starts, tiles=SPLIT_TILES)
    assert torch.equal(got, y)


def test_batch_invariant_across_batch_sizes():
    """Batch-invariant mode: the same rows (K = 600: three splits of 256, the last 88 wide) give the
    same bits alone, among a few rows and at other positions of a batch of 37 rows with 6 slots,
    in float32 and bfloat16 (bits of a bfloat16 sum are the kernel's own, not the reference's)."""
    for dtype in (torch.float32, torch.bfloat16):
        y, x, a, b, scale, slots, starts, slices = _case(T=37, K=600, L=6, seed=11, dtype=dtype)
        assert lora_tiles(37, True) == lora_tiles(4096, True) == DECODE_TILES
        whole = y.clone()
        lora_add(whole, x, a, b, scale, slots, starts, slices, batch_invariant=True)
        perm = torch.randperm(37, generator=torch.Generator().manual_seed(1))
        shuffled = y[perm].clone()
        lora_add(shuffled, x[perm], a, b, scale, slots[perm], starts, slices, batch_invariant=True)
        assert torch.equal(shuffled, whole[perm])
        for rows in ([3], [20, 21, 22, 30]):
            part = y[rows].clone()
            lora_add(part, x[rows], a, b, scale, slots[rows], starts, slices, batch_invariant=True)
            assert torch.equal(part, whole[rows])


def test_default_mode_tiles_by_rows():
    assert lora_tiles(PREFILL_ROWS, False) == DECODE_TILES
    assert lora_tiles(PREFILL_ROWS + 1, False) == PREFILL_TILES
    with pytest.raises(ValueError, match="multiple"):
        y, x, a, b, scale, slots, starts, _ = _case(T=2)
        lora_add_triton(y, x, a, b, scale, slots, starts, tiles=LoRATiles(16, 100, 64, 32, 1))
