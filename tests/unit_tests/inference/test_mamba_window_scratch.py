"""The state manager's speculative window scratch: allocated once per layer with the padding
slot included, counted in ``nbytes``, and ``commit_windows`` writes exactly the given rows'
slots of every layer (conv and SSM) from scratch[slot, accepted]."""
from __future__ import annotations

import torch

from megatron_async.inference.contexts.mamba_states import MambaStateManager, window_rows
from megatron_async.inference.device import DeviceFacade
from megatron_async.models.base import MambaStateSpec


def test_window_scratch_shapes_bytes_and_commit():
    spec = MambaStateSpec(num_layers=2, conv_shape=(6, 3), ssm_shape=(2, 4, 5))
    mgr = MambaStateManager(spec, num_slots=4, block_size=8, device=DeviceFacade("cpu"), dtype=torch.bfloat16)
    live = mgr.nbytes
    assert live == 2 * 5 * (6 * 3 * 2 + 2 * 4 * 5 * 4)
    mgr.enable_windows(3)
    assert mgr.nbytes == 4 * live, "three window positions per slot on top of the live state"
    assert [t.shape for t in mgr.ssm_window_states] == [torch.Size([5, 3, 2, 4, 5])] * 2
    assert mgr.conv_window_states[0].dtype == torch.bfloat16 and mgr.ssm_window_states[0].dtype == torch.float32

    g = torch.Generator().manual_seed(0)
    for t in mgr.conv_states + mgr.ssm_states + mgr.conv_window_states + mgr.ssm_window_states:
        t.copy_(torch.randn(t.shape, generator=g))
    before = [t.clone() for t in mgr.conv_states + mgr.ssm_states]
    slots, accepted = torch.tensor([3, 1]), torch.tensor([2, 0])
    mgr.commit_windows(slots, accepted)
    for pool, scratch, old in zip(mgr.conv_states + mgr.ssm_states, mgr.conv_window_states + mgr.ssm_window_states, before):
        assert torch.equal(pool[3], scratch[3, 2]) and torch.equal(pool[1], scratch[1, 0])
        assert torch.equal(pool[[0, 2, 4]], old[[0, 2, 4]])


def test_commit_verified_skips_rows_without_drafts():
    """Rows without drafts (prefill chunks, plain decode rows) advanced their slots in place:
    the commit must leave those slots alone."""
    spec = MambaStateSpec(num_layers=1, conv_shape=(2, 1), ssm_shape=(1, 1, 2))
    mgr = MambaStateManager(spec, num_slots=3, block_size=4, device=DeviceFacade("cpu"), dtype=torch.float32)
    mgr.enable_windows(2)
    for i, t in enumerate(mgr.conv_window_states + mgr.ssm_window_states):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view_as(t) + 100 * (i + 1))
    before = [t.clone() for t in mgr.conv_states + mgr.ssm_states]
    mgr.commit_verified(torch.tensor([2, 0, 1]), torch.tensor([1, 0, 1]), torch.tensor([1, 0, 0]))
    for pool, scratch, old in zip(mgr.conv_states + mgr.ssm_states, mgr.conv_window_states + mgr.ssm_window_states, before):
        assert torch.equal(pool[2], scratch[2, 1]) and torch.equal(pool[1], scratch[1, 0])
        assert torch.equal(pool[0], old[0]), "a row without drafts was committed over"


def test_window_rows_layout():
    assert window_rows([0, 0], 2) == (None, 0)
    assert window_rows([3, 3], 8) == ([True, True], 4)
    assert window_rows([3, 2], 7) == ([True, True], 0)  # ragged drafts: padded windows
    assert window_rows([0, 2], 4) == ([False, True], 0)  # a prefill / plain decode row beside a window
