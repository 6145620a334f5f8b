"""The EP exchange's one-kernel packing against the torch code it replaces on CUDA (pads, a
concatenation, then copies and a subtraction after the gather): the same bytes in the sent
rows, the same local ids and weights out of gathered rows. Interpreter on CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels.triton_ep_pack import ep_pack, ep_unpack  # noqa: E402
from megatron_async.models.layers.moe import pack_exchange_rows, unpack_exchange_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, rows, h, k", [(5, 8, 48, 2), (3, 3, 64, 8), (0, 4, 16, 3), (9, 12, 40, 1)])
def test_pack_and_unpack_equal_the_torch_exchange_code(dtype, n, rows, h, k):
    g = torch.Generator().manual_seed(n * 31 + h + k)
    E, first = 16, 4
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    ids = torch.randint(0, E, (n, k), generator=g, dtype=torch.int32).to(DEVICE)
    weights = torch.rand(n, k, generator=g).to(DEVICE)
    packed = ep_pack(x, ids, weights, rows, E)
    ref = pack_exchange_rows(x, ids, weights, rows, E)
    assert packed.dtype == dtype and torch.equal(packed.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                                 ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    gathered = torch.cat([packed, packed.flip(0)])  # as an all-gather of two ranks would stack them
    local_ids, w = ep_unpack(gathered, h, k, first)
    ref_ids, ref_w = unpack_exchange_rows(gathered, h, k, first)
    assert torch.equal(local_ids, ref_ids) and torch.equal(w, ref_w)
    assert local_ids.is_contiguous() and w.is_contiguous()


def test_bad_inputs():
    x = torch.randn(2, 8, device=DEVICE)
    ids = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError):
        ep_pack(x, ids.long(), torch.rand(2, 2, device=DEVICE), 2, 4)
    with pytest.raises(ValueError):
        ep_pack(x, ids, torch.rand(2, 2, device=DEVICE), 1, 4)
