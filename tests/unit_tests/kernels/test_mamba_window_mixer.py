"""The Mamba2 mixer with speculative verification rows: a window of T tokens per row gives the
outputs of T sequential decode steps, leaves the state after each token in the window scratch
and the slot untouched, and committing any accepted count makes the slot equal to the state
after that many sequential steps. Windows mixed with prefill chunks and plain decode rows
leave those rows' results unchanged. Both backends (TORCH, TRITON)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.config import MambaBackend  # noqa: E402
from megatron_async.forward_batch import MambaMetadata  # noqa: E402
from megatron_async.kernels import mamba_window_ops  # noqa: E402
from megatron_async.models.layers.mamba_step_plan import MambaStepPlan  # noqa: E402
from tests.unit_tests.kernels.test_mamba_triton import DEVICE, _mixer, _randn  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(params=[MambaBackend.TORCH, MambaBackend.TRITON])
def backend(request) -> bool:
    """Whether the ops run the Triton kernels (TRITON) or the torch reference (TORCH)."""
    return request.param == MambaBackend.TRITON


def _meta(lengths: list[int], slots: list[int], has_init: list[bool], window_rows: list[bool] | None = None,
          window_tokens: int = 0) -> MambaMetadata:
    return MambaMetadata.for_rows(lengths, slots, has_init, DEVICE, window_rows, window_tokens)


def _scratch(mixer, num_slots: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv_shape, ssm_shape = mixer.state_shapes()
    return (torch.full((num_slots, T, *conv_shape), 9.0, device=DEVICE),
            torch.full((num_slots, T, *ssm_shape), 9.0, device=DEVICE))


def _sequential(mixer, x_rows: torch.Tensor, pools, slots: list[int], triton: bool):
    """T decode steps of the rows x_rows [R, T, hidden]: (outputs [R, T, hidden], per-token
    (conv, ssm) states of the rows' slots [R, T, ...])."""
    conv_pool, ssm_pool = (t.clone() for t in pools)
    R, T = x_rows.shape[:2]
    outs, convs, ssms = [], [], []
    for t in range(T):
        plan = MambaStepPlan.build(_meta([1] * R, slots, [True] * R), triton)
        outs.append(mixer.mix(x_rows[:, t], conv_pool, ssm_pool, plan))
        convs.append(conv_pool[slots].clone())
        ssms.append(ssm_pool[slots].clone())
    return torch.stack(outs, 1), torch.stack(convs, 1), torch.stack(ssms, 1)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_uniform_window_step_equals_sequential_decodes_and_commits(backend, k):
    T, slots = k + 1, [5, 0, 3]
    mixer, g = _mixer(20 + k), torch.Generator().manual_seed(21 + k)
    conv_shape, ssm_shape = mixer.state_shapes()
    pools = (_randn(g, 8, *conv_shape), _randn(g, 8, *ssm_shape))
    x = _randn(g, len(slots), T, 16)
    ref_out, ref_conv, ref_ssm = _sequential(mixer, x, pools, slots, backend)

    conv_pool, ssm_pool = (t.clone() for t in pools)
    scratch = _scratch(mixer, 8, T)
    plan = MambaStepPlan.build(_meta([T] * 3, slots, [True] * 3, [True] * 3, window_tokens=T), backend)
    assert plan.window_only == T
    out = mixer.mix(x.flatten(0, 1), conv_pool, ssm_pool, plan, scratch)
    torch.testing.assert_close(out.view_as(ref_out), ref_out, **TOL)
    torch.testing.assert_close(scratch[0][slots], ref_conv, **TOL)
    torch.testing.assert_close(scratch[1][slots], ref_ssm, **TOL)
    assert torch.equal(conv_pool, pools[0]) and torch.equal(ssm_pool, pools[1]), "the window wrote a slot"

    accepted = torch.tensor([k, 0, k // 2], device=DEVICE)
    mamba_window_ops.commit_window_states([conv_pool, ssm_pool], list(scratch), torch.tensor(slots, device=DEVICE), accepted,
                                          triton=backend)
    for r, (s, a) in enumerate(zip(slots, accepted.tolist())):
        torch.testing.assert_close(conv_pool[s], ref_conv[r, a], **TOL)
        torch.testing.assert_close(ssm_pool[s], ref_ssm[r, a], **TOL)
    others = [s for s in range(8) if s not in slots]
    assert torch.equal(conv_pool[others], pools[0][others]) and torch.equal(ssm_pool[others], pools[1][others])


def test_windows_inside_a_mixed_step(backend):
    """Prefill chunks, a one-token decode row and verification windows of different lengths
    (3, 1 and 2 tokens) in one step: windows match sequential decodes, the other rows match
    the same step without the windows."""
    mixer, g = _mixer(31), torch.Generator().manual_seed(32)
    conv_shape, ssm_shape = mixer.state_shapes()
    pools = (_randn(g, 9, *conv_shape), _randn(g, 9, *ssm_shape))
    lengths = [3, 5, 1, 1, 4, 2]
    is_window = [True, False, True, False, False, True]
    slots, has_init = [7, 0, 2, 5, 1, 4], [True, True, True, True, False, True]
    x = _randn(g, sum(lengths), 16)
    cu = [sum(lengths[:r]) for r in range(len(lengths) + 1)]

    conv_pool, ssm_pool = (t.clone() for t in pools)
    scratch = _scratch(mixer, 9, 3)
    out = mixer.mix(x, conv_pool, ssm_pool, MambaStepPlan.build(_meta(lengths, slots, has_init, is_window), backend), scratch)

    plain = [r for r in range(6) if not is_window[r]]
    sub_x = torch.cat([x[cu[r]:cu[r + 1]] for r in plain])
    ref_pools = [t.clone() for t in pools]
    ref = mixer.mix(sub_x, *ref_pools, MambaStepPlan.build(_meta([lengths[r] for r in plain], [slots[r] for r in plain],
                                                                 [has_init[r] for r in plain]), backend))
    torch.testing.assert_close(torch.cat([out[cu[r]:cu[r + 1]] for r in plain]), ref, **TOL)
    torch.testing.assert_close(conv_pool, ref_pools[0], **TOL)  # plain rows advanced, window slots untouched
    torch.testing.assert_close(ssm_pool, ref_pools[1], **TOL)
    for r in (0, 2, 5):
        rows = x[cu[r]:cu[r + 1]][None]
        seq_out, seq_conv, seq_ssm = _sequential(mixer, rows, pools, [slots[r]], backend)
        torch.testing.assert_close(out[cu[r]:cu[r + 1]], seq_out[0], **TOL)
        torch.testing.assert_close(scratch[0][slots[r], : lengths[r]], seq_conv[0], **TOL)
        torch.testing.assert_close(scratch[1][slots[r], : lengths[r]], seq_ssm[0], **TOL)


def test_window_rows_without_scratch_is_an_error():
    mixer = _mixer(1)
    conv_shape, ssm_shape = mixer.state_shapes()
    plan = MambaStepPlan.build(_meta([2], [0], [True], [True], window_tokens=2))
    with pytest.raises(ValueError, match="window scratch"):
        mixer.mix(torch.zeros(2, 16, device=DEVICE), torch.zeros(2, *conv_shape, device=DEVICE),
                  torch.zeros(2, *ssm_shape, device=DEVICE), plan)
