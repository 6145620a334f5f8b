"""The one-kernel softmax top-k router against the torch router code (``TopKRouter``'s
softmax path) on fresh random logits: same experts in the same order, weights to float32
rounding, with and without renormalisation and bf16 rounding; ties go to the lower id. In
Triton's interpreter on CPU, compiled on CUDA."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.kernels.triton_moe_router import softmax_topk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_router(logits: torch.Tensor, k: int, norm: bool, round_to):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to is not None:
        weights = weights.to(round_to).float()
    return ids.to(torch.int32), weights


@pytest.mark.parametrize("n, E, k", [(1, 8, 2), (7, 60, 4), (33, 128, 8), (5, 6, 6)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype, round_to", [(torch.float32, None), (torch.bfloat16, torch.bfloat16)])
def test_softmax_topk_matches_the_torch_router(n, E, k, norm, dtype, round_to):
    g = torch.Generator().manual_seed(n * 131 + E + k)
    logits = (torch.randperm(n * E, generator=g).float() / (n * E)).view(n, E)  # distinct values: no ties
    logits = (logits * 6 - 3).to(DEVICE, dtype)
    ids, weights = softmax_topk(logits, k, norm, round_to)
    ref_ids, ref_w = _torch_router(logits, k, norm, round_to)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (n, k)
    if dtype == torch.float32:  # bf16 logits may tie: compare the chosen experts' weights only
        assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5 if round_to is None else 1e-2, atol=1e-6)
    picked = torch.softmax(logits.float(), -1).gather(1, ids.long())
    assert (picked[:, :-1] >= picked[:, 1:]).all()  # sorted by weight, as torch.topk returns them


def test_ties_go_to_the_lower_expert_and_rows_are_independent():
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0], [3.0, 0.0, 0.0, 0.0, 0.0]], device=DEVICE)
    ids, weights = softmax_topk(logits, 3, norm=True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3, device=DEVICE))
    assert softmax_topk(logits[:0], 3, norm=True)[0].shape == (0, 3)
    with pytest.raises(ValueError):
        softmax_topk(logits, 6, norm=True)


def test_record_gets_the_ids_in_a_strided_routing_buffer():
    """Routing replay: the kernel also stores the ids (int16) into layer 1 of a [T, L, k] buffer,
    leaving the other layers and the tokens past n untouched."""
    n, E, k = 5, 16, 3
    logits = torch.randn(n, E, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    buf = torch.full((8, 2, k), -1, dtype=torch.int16, device=DEVICE)
    ids, _ = softmax_topk(logits, k, norm=True, record=buf[:n, 1])
    assert torch.equal(buf[:n, 1].int(), ids)
    assert (buf[:, 0] == -1).all() and (buf[n:] == -1).all()
    with pytest.raises(ValueError):
        softmax_topk(logits, k, norm=True, record=buf[:n, 1].int())
