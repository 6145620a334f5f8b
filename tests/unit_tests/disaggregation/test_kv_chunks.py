"""An "ipc" import copies the prefill engine's shared buffer (``KVLayout.pack``: every layer's
slice of all blocks, layer after layer) into its pool chunk by chunk: each chunk must take every
layer's part of its blocks, whatever the chunk size (fp32 and an e4m3 pool seen as bytes)."""
from types import SimpleNamespace

import pytest
import torch

from megatron_async.disaggregation.ipc_import import SharedImports
from megatron_async.disaggregation.kv_layout import KVLayout


def _pool(dtype, seed: int, layers: int = 3, blocks: int = 12):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, blocks, 4, 2, 8), (2, blocks, 4, 1, 16), (2, blocks, 4, 2, 8)][:layers]
    caches = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    return SimpleNamespace(kv_caches=caches, mamba=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 3, 7])
def test_chunked_copy_of_a_packed_buffer_fills_every_layer(dtype, blocks_per_chunk):
    src, dst = _pool(dtype, 1), _pool(dtype, 2)
    src_layout, dst_layout = KVLayout(src), KVLayout(dst)
    src_ids, dst_ids = [5, 0, 9, 3, 11, 7, 2], [1, 4, 6, 8, 10, 0, 3]
    before = [t.clone() for t in dst.kv_caches]
    times = SimpleNamespace(add=lambda *a: None)
    imports = SharedImports(dst_layout, blocks_per_chunk * dst_layout.block_bytes(), times)
    assert len(dst_layout.chunks(len(dst_ids), imports.chunk_bytes)) == -(-len(dst_ids) // blocks_per_chunk)
    imports.start(7, src_layout.pack(src_ids, None), dst_ids)
    assert [rid for rid, _ in imports.landed()] == [7]
    for s, d, b in zip(src.kv_caches, dst.kv_caches, before):
        for i, j in zip(src_ids, dst_ids):
            assert torch.equal(d[:, j].view(torch.uint8), s[:, i].view(torch.uint8))
        untouched = [j for j in range(d.shape[1]) if j not in dst_ids]
        assert torch.equal(d[:, untouched].view(torch.uint8), b[:, untouched].view(torch.uint8))
