"""The Triton sampler kernels compiled on CUDA at Qwen3's 151,936-token vocabulary, against the
torch reference (sampling.py) and torch's argmax. The CPU tests (test_triton_sampling.py) run
the same kernels interpreted at tiny shapes; these prove the compiled launches at the engine's
row counts. Times: ``python -m benchmarks kernel-times sampler-kernels`` / ``small-kernels``."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels import triton_sampling  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 151_936


def _logits(rows: int, seed: int, count: int = 4) -> list[torch.Tensor]:
    """``count`` bf16 [rows, VOCAB] logits; the first with a tie at its top (ids 5 and 7)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = [torch.randn(rows, VOCAB, generator=g, device="cuda").to(torch.bfloat16) for _ in range(count)]
    sets[0][:, 5] = sets[0][:, 7] = sets[0].max() + 1
    return sets


@pytest.mark.parametrize("rows", [1, 64, 128, 256])
def test_argmax_is_torchs_first_largest_index(rows):
    for x in _logits(rows, seed=rows):
        assert torch.equal(triton_sampling.argmax(x), x.argmax(-1))


@pytest.mark.parametrize("chunk, block", [(c, b) for c in (4096, 8192, 16384) for b in (1024, 2048, 4096) if b <= c])
@pytest.mark.parametrize("warps", [4, 8])
def test_argmax_launch_settings_keep_the_answer(chunk, block, warps):
    for x in _logits(128, seed=chunk + block + warps, count=2):
        assert torch.equal(triton_sampling.argmax(x, chunk=chunk, block=block, num_warps=warps), x.argmax(-1))
