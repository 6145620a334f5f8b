"""Live Mamba state slots of a hybrid model: one conv + SSM state per active request.

A slot is taken at admission and kept while paused; eviction and finish free it (an
evicted request recomputes its state from its tokens). The last slot is a padding slot
that padded CUDA-graph rows read and write harmlessly."""
from __future__ import annotations

import torch

from megatron_async.config import InferenceConfig
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.models.base import CausalLM


class MambaStateManager:
    def __init__(self, spec, num_slots: int, device: DeviceFacade, dtype: torch.dtype):
        dev = device.device
        self.num_slots = num_slots
        self.padding_slot = num_slots  # one extra slot beyond the live ones
        self.conv_states = [torch.zeros(num_slots + 1, *spec.conv_shape, dtype=dtype, device=dev) for _ in range(spec.num_layers)]
        self.ssm_states = [torch.zeros(num_slots + 1, *spec.ssm_shape, dtype=torch.float32, device=dev) for _ in range(spec.num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))

    @classmethod
    def create(cls, model: CausalLM, config: InferenceConfig, device: DeviceFacade, dtype: torch.dtype):
        spec = model.mamba_state_spec()
        if spec is None or spec.num_layers == 0:
            return None
        return cls(spec, config.max_requests, device, dtype)

    def assign_slot(self, req: DynamicInferenceRequest) -> None:
        assert req.state_slot < 0, "request already holds a state slot"
        req.state_slot = self._free.pop()  # max_requests bounds active requests, so never empty

    def free_slot(self, req: DynamicInferenceRequest) -> None:
        if req.state_slot >= 0:
            self._free.append(req.state_slot)
            req.state_slot = -1

    # Prefix caching of Mamba states is not wired yet: without a cached state no KV prefix
    # can be skipped for a hybrid model, so the match depth is 0.
    def restorable_prefix_blocks(self, req: DynamicInferenceRequest, limit: int, ctx) -> int:
        return 0

    def restore_prefix_state(self, req: DynamicInferenceRequest, block_hash: int | None) -> None:
        pass

    def on_block_registered(self, req: DynamicInferenceRequest, block_index: int, block_hash: int) -> None:
        pass
