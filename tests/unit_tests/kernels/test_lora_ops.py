"""The batched LoRA op: the Triton shrink / expand pair (interpreted here) equals the torch
reference and a per-row loop, rows of slot -1 stay as they are, and a row's result does not
depend on the rows around it."""
import pytest
import torch

from megatron_async.kernels.lora_ops import lora_add, lora_add_reference
from megatron_async.kernels.triton_lora import lora_add_triton


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
