"""Cached Mamba states for hybrid prefix caching: a fixed pool with LRU eviction.

A hybrid request can skip prefill only as deep as BOTH its KV blocks and the Mamba state
at that block boundary are cached. States are keyed by the chain hash of the block that
ends at the boundary (the same hash the KV allocator uses), live in a separate map from
"KV block cached", and are dropped when that KV block is reclaimed. Copies between the
live slots and this pool are enqueued on the device stream, so stream order makes a
store visible to every later restore."""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from megatron_async.inference.contexts.kv_block_allocator import BlockKey

log = logging.getLogger("megatron_async")


class MambaPrefixCache:
    def __init__(self, conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor], budget_gb: float):
        per_state = sum(t[0].numel() * t.element_size() for t in conv_states + ssm_states)
        self.capacity = int(budget_gb * 1e9 // per_state) if budget_gb > 0 else 0
        if 0 < budget_gb and self.capacity == 0:
            log.warning(
                "prefix_caching_mamba_gb=%s holds no Mamba state (one needs %.3f GB): Mamba prefix caching is off",
                budget_gb, per_state / 1e9,
            )
        n = max(self.capacity, 1)
        self.conv = [torch.zeros(n, *t.shape[1:], dtype=t.dtype, device=t.device) for t in conv_states]
        self.ssm = [torch.zeros(n, *t.shape[1:], dtype=t.dtype, device=t.device) for t in ssm_states]
        self._live_conv, self._live_ssm = conv_states, ssm_states
        self._slot_of: OrderedDict[BlockKey, int] = OrderedDict()  # block hash -> pool slot, LRU first
        self._free = list(range(self.capacity - 1, -1, -1))
        self._pending: list[tuple[int, int]] = []  # (live slot, pool slot) to copy after the forward
        self.stored = self.restored = self.evicted = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def has(self, block_hash: BlockKey) -> bool:
        return block_hash in self._slot_of

    def store(self, live_slot: int, block_hash: BlockKey) -> None:
        """Claim a pool slot for the state a live slot will hold after the launch being
        assembled; the copy itself is enqueued by ``flush`` once that forward is enqueued."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slot_of.popitem(last=False)
            self.evicted += 1
        self._slot_of[block_hash] = slot
        self._pending.append((live_slot, slot))
        self.stored += 1

    def flush(self) -> None:
        """Enqueue the copies claimed by ``store`` (called right after the step's forward)."""
        for live_slot, slot in self._pending:
            self._copy(self._live_conv, self.conv, live_slot, slot)
            self._copy(self._live_ssm, self.ssm, live_slot, slot)
        self._pending.clear()

    def restore(self, block_hash: BlockKey, live_slot: int) -> None:
        slot = self._slot_of[block_hash]
        self._slot_of.move_to_end(block_hash)
        self._copy(self.conv, self._live_conv, slot, live_slot)
        self._copy(self.ssm, self._live_ssm, slot, live_slot)
        self.restored += 1

    def invalidate(self, block_hash: BlockKey) -> None:
        """The KV block ending at this boundary was reclaimed: its state is unusable."""
        slot = self._slot_of.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
            self.evicted += 1

    @staticmethod
    def _copy(src: list[torch.Tensor], dst: list[torch.Tensor], i: int, j: int) -> None:
        for s, d in zip(src, dst):
            d[j].copy_(s[i], non_blocking=True)
