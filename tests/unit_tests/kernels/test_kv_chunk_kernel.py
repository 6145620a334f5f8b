"""The one-launch KV chunk gather / scatter (``triton_kv_chunk``, interpreted on CPU; on a GPU
``gpu``) writes exactly the bytes of ``KVLayout.pack_into`` / ``scatter``'s per-layer torch ops:
fp32, bf16 and e4m3 pools, layers of different head counts and head sizes (a hybrid or MTP pool),
chunks of one to all blocks, block ids in any order; blocks outside the chunk and the Mamba states
stay as they were. Rows that are not whole 16-byte units take the byte-wise form."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_async.disaggregation.kv_layout import KVLayout

pytest.importorskip("triton")

BLOCKS = 13
IDS = [5, 0, 12, 3, 11, 7, 2, 9]  # (not sorted, not contiguous)
SHAPES = {
    "mixed_heads": [(4, 2, 8), (4, 1, 16), (4, 3, 8), (4, 2, 8)],  # [block, heads, head_dim] per layer
    "odd_rows": [(3, 1, 3), (3, 2, 5)],  # rows of 9 and 30 elements: no 16-byte units
}


def _context(dtype, shapes, seed: int, device: str = "cpu", mamba: bool = False):
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(2, BLOCKS, *s, generator=g).to(dtype).to(device) for s in shapes]
    states = None
    if mamba:
        states = SimpleNamespace(conv_states=[torch.randn(4, 3, 6, generator=g).to(device)],
                                 ssm_states=[torch.randn(4, 2, 4, 4, generator=g).to(device)])
    return SimpleNamespace(kv_caches=caches, mamba=states)


def _pair(dtype, shapes, seed: int, device: str = "cpu", mamba: bool = False):
    """(reference layout, kernel layout) over two identical pools."""
    a, b = _context(dtype, shapes, seed, device, mamba), _context(dtype, shapes, seed, device, mamba)
    return KVLayout(a, one_launch=False), KVLayout(b, one_launch=True)


def _bytes(layout: KVLayout) -> list[torch.Tensor]:
    return [t.view(torch.uint8).cpu() for t in layout.kv] + [t.view(torch.uint8).cpu() for t in layout.states]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shapes", sorted(SHAPES))
@pytest.mark.parametrize("per_chunk", [1, 3, len(IDS)])
def test_gather_and_scatter_write_the_torch_ops_bytes(dtype, shapes, per_chunk):
    ref, ker = _pair(dtype, SHAPES[shapes], seed=1, mamba=True)
    _, src = _pair(dtype, SHAPES[shapes], seed=2)
    states_before = [t.clone() for t in ker.states]
    idx = torch.tensor(IDS)
    for first, n in ref.chunks(len(IDS), per_chunk * ref.block_bytes()):
        part = idx[first:first + n]
        want = torch.empty(n * ref.block_bytes(), dtype=torch.uint8)
        got = torch.full_like(want, 0x5A)
        ref.pack_into(want, part)
        ker.pack_into(got, part)
        assert torch.equal(got, want), (first, n)
        assert ker._table is not None and ker._table.aligned == (shapes == "mixed_heads")  # (which form ran)
        incoming = torch.empty_like(want)
        src.pack_into(incoming, part)  # (another pool's blocks, through the kernel too)
        ref.scatter(incoming, part)
        ker.scatter(incoming.clone(), part)
    for got, want in zip(_bytes(ker), _bytes(ref)):
        assert torch.equal(got, want)
    for t, before in zip(ker.states, states_before):
        assert torch.equal(t, before)
    untouched = [j for j in range(BLOCKS) if j not in IDS]
    for t, original in zip(ker.kv, _context(dtype, SHAPES[shapes], seed=1).kv_caches):
        assert torch.equal(t[:, untouched], original.view(t.dtype)[:, untouched])


def test_a_pool_moved_since_the_table_gets_a_new_table():
    ref, ker = _pair(torch.float32, SHAPES["mixed_heads"], seed=3)
    idx = torch.tensor(IDS[:3])
    out = torch.empty(3 * ker.block_bytes(), dtype=torch.uint8)
    ker.pack_into(out, idx)
    first = ker._table
    ker.kv[1] = ker.kv[1].clone()  # (another address; the engine's pools never move, the table checks)
    ker.pack_into(out, idx)
    want = torch.empty_like(out)
    ref.pack_into(want, idx)
    assert ker._table is not first and torch.equal(out, want)


def test_a_buffer_of_the_wrong_size_is_refused():
    _, ker = _pair(torch.float32, SHAPES["mixed_heads"], seed=4)
    with pytest.raises(ValueError, match="contiguous bytes expected"):
        ker.pack_into(torch.empty(ker.block_bytes(), dtype=torch.uint8), torch.tensor(IDS[:2]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_on_cuda_a_layout_moves_chunks_with_the_kernel(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ctx = _context(dtype, SHAPES["mixed_heads"], seed=5, device="cuda")
    ker, ref = KVLayout(ctx), KVLayout(_context(dtype, SHAPES["mixed_heads"], seed=5, device="cuda"), one_launch=False)
    assert ker.one_launch
    idx = torch.tensor(IDS, device="cuda")
    got, want = (torch.empty(len(IDS) * ref.block_bytes(), dtype=torch.uint8, device="cuda") for _ in range(2))
    ker.pack_into(got, idx)
    ref.pack_into(want, idx)
    assert ker._table is not None and ker._table.aligned and torch.equal(got, want)
    incoming = torch.randint(0, 120, got.shape, dtype=torch.uint8, device="cuda")
    ker.scatter(incoming, idx)
    ref.scatter(incoming, idx)
    assert all(torch.equal(a, b) for a, b in zip(ker.kv, ref.kv))
