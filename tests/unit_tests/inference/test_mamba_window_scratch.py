"""The state manager's speculative window scratch (allocated once per layer with the padding
slot included, counted in ``nbytes``, sized from the config) and the host layout of a step's
Mamba windows."""
from __future__ import annotations

import torch

from megatron_async.config import InferenceConfig
from megatron_async.forward_batch import mamba_row_order
from megatron_async.inference.contexts.mamba_states import MambaStateManager, window_rows
from megatron_async.inference.device import DeviceFacade
from megatron_async.models.base import MambaStateSpec


def test_window_scratch_shapes_and_bytes():
    spec = MambaStateSpec(num_layers=2, conv_shape=(6, 3), ssm_shape=(2, 4, 5))
    mgr = MambaStateManager(spec, num_slots=4, block_size=8, device=DeviceFacade("cpu"), dtype=torch.bfloat16)
    live = mgr.nbytes
    assert live == 2 * 5 * (6 * 3 * 2 + 2 * 4 * 5 * 4)
    mgr.enable_windows(3)
    assert mgr.nbytes == 4 * live, "three window positions per slot on top of the live state"
    assert [t.shape for t in mgr.ssm_window_states] == [torch.Size([5, 3, 2, 4, 5])] * 2
    assert mgr.conv_window_states[0].dtype == torch.bfloat16 and mgr.ssm_window_states[0].dtype == torch.float32


def test_window_rows_layout():
    assert window_rows([0, 0], 2) == (None, 0)
    assert window_rows([3, 3], 8) == ([True, True], 4)
    assert window_rows([3, 2], 7) == ([True, True], 0)  # ragged drafts: padded windows
    assert window_rows([0, 2], 4) == ([False, True], 0)  # a prefill / plain decode row beside a window


def test_mamba_row_order_puts_windows_then_several_token_rows_first():
    cu = [0, 1, 5, 8, 9, 12]  # rows of 1, 4, 3, 1, 3 tokens
    assert mamba_row_order(cu, None) == ([1, 2, 4, 0, 3], 3)
    assert mamba_row_order(cu, [False, False, True, False, False]) == ([2, 1, 4, 0, 3], 2)  # row 2: a window
    assert mamba_row_order([0, 1, 2], [False, False]) == ([0, 1], 0)


def test_scratch_follows_the_config():
    class Model:
        def mamba_state_spec(self):
            return MambaStateSpec(num_layers=1, conv_shape=(2, 1), ssm_shape=(1, 1, 2))

    off = MambaStateManager.create(Model(), InferenceConfig(max_requests=3).cache_sizing(), DeviceFacade("cpu"), torch.float32)
    on = MambaStateManager.create(Model(), InferenceConfig(max_requests=3, num_speculative_tokens=2).cache_sizing(), DeviceFacade("cpu"), torch.float32)
    assert off.window_tokens == 0 and not off.conv_window_states
    assert on.window_tokens == 3 and on.ssm_window_states[0].shape == (4, 3, 1, 1, 2)
