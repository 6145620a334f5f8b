"""Live Mamba state slots of a hybrid model: one conv + SSM state per active request.

A slot is taken at admission and kept while paused; eviction and finish free it (an
evicted request recomputes its state from its tokens). The last slot is a padding slot
that padded CUDA-graph rows read and write harmlessly.

With speculative decoding every slot also owns a window scratch of k + 1 states per layer: a
verification row leaves the state after each of its tokens there and its slot untouched, and
the model's ``commit_speculative`` copies the accepted position's state into the slot on the
device."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from megatron_async.config import CacheSizing
from megatron_async.inference.contexts.kv_block_allocator import BlockKey
from megatron_async.inference.contexts.mamba_prefix_cache import MambaPrefixCache
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.request import DynamicInferenceRequest

log = logging.getLogger("megatron_async")

if TYPE_CHECKING:  # type-only: models import contexts (metadata), not the reverse
    from megatron_async.models.base import CausalLM


class MambaStateManager:
    def __init__(self, spec, num_slots: int, block_size: int, device: DeviceFacade, dtype: torch.dtype):
        dev = device.device
        self.block_size = block_size
        self.prefix_cache: MambaPrefixCache | None = None
        self.num_slots = num_slots
        self.padding_slot = num_slots  # one extra slot beyond the live ones
        self.conv_states = [torch.zeros(num_slots + 1, *spec.conv_shape, dtype=dtype, device=dev) for _ in range(spec.num_layers)]
        self.ssm_states = [torch.zeros(num_slots + 1, *spec.ssm_shape, dtype=torch.float32, device=dev) for _ in range(spec.num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))
        self.window_tokens = 0
        self.conv_window_states: list[torch.Tensor] = []
        self.ssm_window_states: list[torch.Tensor] = []

    @classmethod
    def create(cls, model: CausalLM, config: CacheSizing, device: DeviceFacade, dtype: torch.dtype):
        spec = model.mamba_state_spec()
        if spec is None or spec.num_layers == 0:
            return None
        mgr = cls(spec, config.max_requests, config.block_size_tokens, device, dtype)
        if config.enable_prefix_caching:
            mgr.enable_prefix_cache(config.prefix_caching_mamba_gb)
        live = mgr.nbytes
        if config.num_speculative_tokens > 0:
            mgr.enable_windows(config.num_speculative_tokens + 1)
        log.info("Mamba states: %.3f GB live (%d slots) + %.3f GB speculative window scratch",
                 live / 1e9, mgr.num_slots, (mgr.nbytes - live) / 1e9)
        return mgr

    def enable_windows(self, window_tokens: int) -> None:
        """Allocate the window scratch once (fixed addresses, graph-safe): per layer
        [slots + 1, window_tokens, *state shape], the padding slot included."""
        self.window_tokens = window_tokens
        self.conv_window_states = [torch.zeros(t.shape[0], window_tokens, *t.shape[1:], dtype=t.dtype, device=t.device)
                                   for t in self.conv_states]
        self.ssm_window_states = [torch.zeros(t.shape[0], window_tokens, *t.shape[1:], dtype=t.dtype, device=t.device)
                                  for t in self.ssm_states]

    @property
    def nbytes(self) -> int:
        """Device bytes of the live states and the window scratch."""
        return sum(t.numel() * t.element_size()
                   for t in self.conv_states + self.ssm_states + self.conv_window_states + self.ssm_window_states)

    def assign_slot(self, req: DynamicInferenceRequest) -> None:
        assert req.state_slot < 0, "request already holds a state slot"
        req.state_slot = self._free.pop()  # max_requests bounds active requests, so never empty

    def free_slot(self, req: DynamicInferenceRequest) -> None:
        if req.state_slot >= 0:
            self._free.append(req.state_slot)
            req.state_slot = -1

    # ------------------------------------------------------------------ prefix caching
    def enable_prefix_cache(self, budget_gb: float) -> None:
        cache = MambaPrefixCache(self.conv_states, self.ssm_states, budget_gb)
        self.prefix_cache = cache if cache.enabled else None

    def matched_depth(self, block_hashes: list[BlockKey]) -> int:
        """Deepest number of matched KV blocks whose end-boundary state is cached (0 = none)."""
        if self.prefix_cache is None:
            return 0
        for d in range(len(block_hashes), 0, -1):
            if self.prefix_cache.has(block_hashes[d - 1]):
                return d
        return 0

    def restore_prefix_state(self, req: DynamicInferenceRequest, block_hash: BlockKey) -> None:
        self.prefix_cache.restore(block_hash, req.state_slot)

    def on_block_registered(self, req: DynamicInferenceRequest, block_index: int, block_hash: BlockKey) -> None:
        """Store the state when this launch's row ends exactly at a boundary worth caching."""
        end = (block_index + 1) * self.block_size
        if self.prefix_cache is not None and end == req.num_computed_tokens and end in req.mamba_store_points:
            self.prefix_cache.store(req.state_slot, block_hash)

    def after_forward(self) -> None:
        """Enqueue the state stores of the launch whose forward was just enqueued."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def on_kv_block_reclaimed(self, block_hash: BlockKey) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.invalidate(block_hash)

    def store_points(self, req: DynamicInferenceRequest, kv_depth: int) -> list[int]:
        """Positions where a prefill chunk must end so their states get cached: the last
        block boundary a later identical prompt may skip to, and the end of a KV match that
        had no state (so the next request with this prefix can skip all of it)."""
        if self.prefix_cache is None:
            return []
        bs = self.block_size
        points = {(len(req.prompt_tokens) - 1) // bs * bs, kv_depth * bs}
        return sorted(p for p in points if p > req.num_computed_tokens)


def window_rows(num_drafts: list[int], num_tokens: int) -> tuple[list[bool] | None, int]:
    """Host layout of a step's Mamba windows: a row runs as a window iff it verifies drafts.
    Returns (window flag per row or None when no row has drafts, T when every row is a window
    of exactly T tokens else 0)."""
    flags = [k > 0 for k in num_drafts]
    if not any(flags):
        return None, 0
    T = num_drafts[0] + 1
    uniform = all(flags) and all(k + 1 == T for k in num_drafts) and T * len(num_drafts) == num_tokens
    return flags, T if uniform else 0

