"""The batch-invariant linear's TMA kernel (prefill rows) against torch's matmul: K cut into
ranges or not, bias or not, M, N and K not multiples of the tiles (the descriptors' zero fill).
Interpreted on CPU (float32), compiled on CUDA (bf16); its bits against the invariant kernel's are
test_batch_invariant_kernels.py's ``gpu`` test."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from megatron_async.kernels.triton_tma_linear import tma_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


@pytest.mark.parametrize("m,n,k,k_per_split,ranges,bias", [
    (200, 160, 200, 64, True, True),  # four ranges, the last cut by K
    (130, 136, 192, 128, True, False),  # two ranges, the second half as deep
    (129, 264, 104, 128, False, True),  # no ranges: K's tail zero-filled (TMA rows: 16-byte multiples), N > 256
])
def test_tma_linear_matches_torch(m, n, k, k_per_split, ranges, bias):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(DTYPE)
    w = torch.randn(n, k, generator=g, device=DEVICE).to(DTYPE)
    b = torch.randn(n, generator=g, device=DEVICE).to(DTYPE) if bias else None
    out = tma_linear(x, w, b, k_per_split, ranges)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = dict(rtol=1e-4, atol=1e-3) if DTYPE == torch.float32 else dict(rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(out.float(), ref, **tol)


def test_tma_linear_refuses_ranges_across_k_steps():
    x, w = torch.zeros(4, 96, device=DEVICE, dtype=DTYPE), torch.zeros(16, 96, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="whole"):
        tma_linear(x, w, None, 96, True)
