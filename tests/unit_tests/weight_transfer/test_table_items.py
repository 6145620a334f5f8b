"""The table copy's bind worked out with arrays and integers: its work items equal a plain loop's
over random pair geometries (short rows grouped, long rows cut into pieces), the merged geometry
equals the tensors' own, and a source piece made in one view from a storage's integers
(``Strided``) equals the view of a view it replaces (plain slices and query-group chunks)."""
import random

import numpy as np
import torch

from megatron_async.models.weight_targets import Chunks, Strided
from megatron_async.weight_transfer.table_copy import _items, merged_geometry


def _loop_items(pairs: list[list[int]], item: int) -> list[list[int]]:
    out = []
    for src, dst, n1, n2, ss0, ss1, ds0, ds1, rows, size in pairs:
        if n2 > item:
            for r in range(rows):
                for col in range(0, n2, item):
                    out.append([src + col * size, dst + col * size, n1, min(n2 - col, item), ss0, ss1, ds0, ds1, r, 1])
        else:
            per = item // n2
            for first in range(0, rows, per):
                out.append([src, dst, n1, n2, ss0, ss1, ds0, ds1, first, min(per, rows - first)])
    return out


def test_items_equal_a_loop_over_each_item():
    rng = random.Random(0)
    for item in (16, 64, 1 << 10):
        pairs = []
        for _ in range(40):
            n1, n2 = rng.randint(1, 9), rng.choice([1, 3, item // 4, item - 1, item, item + 1, 3 * item + 5])
            pairs.append([rng.randrange(1 << 40), rng.randrange(1 << 40), n1, n2, rng.randint(0, 999),
                          rng.randint(0, 999), rng.randint(0, 999), rng.randint(0, 999), n1 * rng.randint(1, 7),
                          rng.choice([1, 2, 4, 8])])
        got = _items(np.array(pairs, dtype=np.int64), item)
        assert got.dtype == np.int64 and got.tolist() == _loop_items(pairs, item)


def _old_geometry(shape, dstride, sstride):
    dims = [(n, d, s) for n, d, s in zip(shape, dstride, sstride) if n != 1]
    if 0 in shape:
        return None
    if not dims:
        return [1, 1, 1], [0, 0, 1], [0, 0, 1]
    merged = [list(dims[0])]
    for n, d, s in dims[1:]:
        if merged[-1][1] == d * n and merged[-1][2] == s * n:
            merged[-1] = [merged[-1][0] * n, d, s]
        else:
            merged.append([n, d, s])
    if merged[-1][1] != 1 or merged[-1][2] != 1 or len(merged) > 3:
        return None
    merged = [[1, 0, 0]] * (3 - len(merged)) + merged
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged]


def test_merged_geometry_equals_the_dim_by_dim_merge():
    rng = random.Random(1)
    for _ in range(2000):
        shape = [rng.choice([0, 1, 1, 2, 3, 4]) for _ in range(rng.randint(0, 5))]
        def strides():
            out, s = [], 1
            for n in reversed(shape):
                out.append(s if rng.random() < 0.8 else rng.choice([0, 1, 2, 7]) * s)
                s *= max(n, 1) * rng.choice([1, 1, 2])
            return out[::-1]
        d, s = strides(), strides()
        assert merged_geometry(shape, d, s) == _old_geometry(shape, d, s), (shape, d, s)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.data_ptr() == b.data_ptr() and torch.equal(a, b))


def test_strided_pieces_equal_the_views_of_views():
    flat = torch.arange(4096, dtype=torch.float32)
    rng = random.Random(2)
    for _ in range(300):
        rows, cols = rng.randint(2, 12), rng.randint(1, 20)
        col_stride = rng.choice([1, cols, cols + 3]) if rng.random() < 0.3 else 1
        stride = (cols * col_stride + rng.randint(0, 4), col_stride)
        offset = rng.randint(0, 100)
        src = Strided(flat, [rows, cols], list(stride), offset)
        tensor = flat.as_strided([rows, cols], stride, offset)
        assert _same_view(src.tensor(), tensor)
        r0, c0 = rng.randint(0, rows - 1), rng.randint(0, cols - 1)
        slices = (slice(r0, rng.randint(r0 + 1, rows)), slice(c0, rng.randint(c0 + 1, cols)))
        assert _same_view(src.piece(slices), tensor[slices])
        assert _same_view(src.piece(slices[:1]), tensor[slices[:1]])
        chunk_rows = rng.randint(1, rows // 2)
        count = rng.randint(1, rows // (chunk_rows + 1) + 1)
        step = chunk_rows + rng.randint(0, 2)
        if (count - 1) * step + chunk_rows <= rows:
            chunks = Chunks(0, count, chunk_rows, step, (slices[1],))
            assert _same_view(src.piece(chunks), chunks.of(tensor))
