"""The fused Triton gated group RMSNorm (interpreter on CPU, compiled on CUDA) against the torch
reference ``gated_rms_norm`` then the cast to the model dtype: odd token counts (1 included),
several group sizes (a power of two or not), both gate orders, z a strided view of a wider
activation as in_proj's output gives it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels.triton_mamba_norm import gated_rms_norm as fused  # noqa: E402
from megatron_async.models.layers.mamba2_mixer import gated_rms_norm  # noqa: E402
from tests.unit_tests.kernels.test_mamba_triton import DEVICE, _gen, _randn  # noqa: E402


@pytest.mark.parametrize("T", [1, 3, 7])
@pytest.mark.parametrize("group_size, groups", [(8, 2), (12, 3), (64, 1)])
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gated_norm_matches_reference(T, group_size, groups, norm_before_gate, dtype):
    g = _gen(T * 1000 + group_size * 10 + norm_before_gate)
    I = group_size * groups
    y = 2 * _randn(g, T, I)  # the SSM output: float32
    zxbc = _randn(g, T, I + 5 + 2 * I, dtype=dtype)  # in_proj's output: z is its first I columns
    z = zxbc[:, :I]
    weight = 1 + 0.5 * _randn(g, I, dtype=dtype)
    ref = gated_rms_norm(y, z, weight, group_size, 1e-5, norm_before_gate).to(dtype)
    out = fused(y, z, weight, group_size, 1e-5, norm_before_gate, dtype)
    assert out.dtype == dtype and out.shape == (T, I) and out.is_contiguous()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    if dtype == torch.bfloat16:  # float32 inside: at most one bf16 rounding step apart
        assert (out.float() - ref.float()).abs().le(ref.float().abs() * 2 ** -7 + 1e-6).all()


def test_fused_gated_norm_strided_y_and_empty():
    g = _gen(5)
    y = _randn(g, 32, 3).t()  # [3, 32] with strides (1, 3)
    z, w = _randn(g, 3, 32), _randn(g, 32)
    torch.testing.assert_close(fused(y, z, w, 16, 1e-6, False, torch.float32),
                               gated_rms_norm(y, z, w, 16, 1e-6, False), rtol=1e-5, atol=1e-5)
    assert fused(y[:0], z[:0], w, 16, 1e-6, True, torch.float32).shape == (0, 32)
    with pytest.raises(ValueError, match="group size"):
        fused(y, z, w, 12, 1e-6, True, torch.float32)
