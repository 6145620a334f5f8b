"""The state manager's speculative window scratch: allocated once per layer with the padding
slot included, counted in ``nbytes``, and ``commit_windows`` writes exactly the given rows'
slots of every layer (conv and SSM) from scratch[slot, accepted]."""
from __future__ import annotations

import torch

from megatron_async.inference.contexts.mamba_states import MambaStateManager
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
