"""engine.suspend / engine.resume: hand device memory to a colocated trainer and take it back.

Tags: "weights" = the model's parameters (and buffers); "kv_cache" = the KV pool, the Mamba
state pools and the CUDA graph pools. The memory itself is released and restored by a
``SuspendBackend`` (memory_suspend.py) at the same addresses, so captured graphs replay as before.

What survives, exactly: running requests (active or paused, holding KV) keep their used KV blocks
and Mamba state slots, copied to host memory at suspend and back at resume (only the used ones:
cheap), so they continue token-identically. Everything else in those pools is zeroed at resume, as
at startup. Prefix-cache entries are not kept: their blocks are re-keyed (``weights_changed``), so
they are never hit again. Weights are copied to host memory (``keep_weights_on_host``) or dropped
for a caller that refills them with ``update_weights``; module buffers (rope tables) are always kept.

Order an RL driver follows: suspend(("weights", "kv_cache")), train, resume(("weights",)),
update_weights(...), resume(("kv_cache",)), resume_generation(). Every other order that would
lose something is refused with ``SuspendError`` and changes nothing. Under TP / EP each rank
suspends and resumes its own memory (no collective); paused steps exchange on the host only, and
every exchange carries each rank's ``blocking_code`` so that, once rank 0 resumes generation
while some rank is still suspended, every rank raises the same ``SuspendError`` at the same step
(``check_ranks_can_generate``) instead of one raising and the others waiting for it."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from megatron_async.inference.device import copy_to_host
from megatron_async.inference.memory_suspend import KV_CACHE, TAGS, WEIGHTS, SuspendBackend
from megatron_async.kernels.kv_cache_fp8 import byte_view


class SuspendError(RuntimeError):
    """A suspend / resume / weight update in an order that would lose memory contents; nothing changed."""


_TAG_BITS = {WEIGHTS: 1, KV_CACHE: 2}
_DROPPED = 4  # weights dropped at suspend and not refilled
_REASON_BITS = 3


def check_ranks_can_generate(code: int) -> None:
    """Raise where the max over ranks of ``MemorySuspender.blocking_code`` says some rank cannot
    generate; it names the highest such rank (a max-reduce keeps one) and why."""
    if not code:
        return
    rank, bits = (code >> _REASON_BITS) - 1, code & ((1 << _REASON_BITS) - 1)
    tags = [tag for tag, bit in _TAG_BITS.items() if bits & bit]
    if tags:
        raise SuspendError(f"rank {rank} is still suspended ({', '.join(tags)}): every rank must resume "
                           "its memory before generation resumes")
    raise SuspendError(f"rank {rank}'s weights were dropped at suspend: refill them with update_weights on "
                       "every rank before generation resumes")


@dataclass
class _KeptKV:
    """Host copies of what running requests hold in the KV cache tag."""

    blocks: torch.Tensor  # block ids (int64)
    kv: list[torch.Tensor] = field(default_factory=list)  # per layer [2, n, block, heads, dim]
    slots: torch.Tensor | None = None  # Mamba state slots
    states: list[torch.Tensor] = field(default_factory=list)  # per tensor [n, ...] (conv then ssm)


def check_tags(tags) -> tuple[str, ...]:
    if isinstance(tags, str):
        tags = (tags,)
    tags = tuple(dict.fromkeys(tags))
    unknown = [t for t in tags if t not in TAGS]
    if unknown or not tags:
        raise ValueError(f"unknown suspend tags {unknown or list(tags)}: use some of {list(TAGS)}")
    return tags


class MemorySuspender:
    """The suspend state of one engine: which tags are released and what was kept on the host."""

    def __init__(self, backend: SuspendBackend | None, context, model: torch.nn.Module):
        self.backend = backend
        self.context = context
        self.model = model
        self.suspended: set[str] = set()
        self.weights_missing = False
        """Weights were dropped (suspend with keep_weights_on_host=False) and not yet refilled."""
        self._weights_host: list[torch.Tensor] | None = None  # parameters, when kept
        self._buffers_host: list[torch.Tensor] = []
        self._kept_kv: _KeptKV | None = None

    # ------------------------------------------------------------------ tensors per tag
    def _params(self) -> list[torch.Tensor]:
        return [p.data for p in self.model.parameters()]

    def _buffers(self) -> list[torch.Tensor]:
        return [b for b in self.model.buffers() if b.numel()]

    def _state_tensors(self) -> list[torch.Tensor]:
        m = self.context.mamba
        if m is None:
            return []
        pools = [*m.conv_states, *m.ssm_states, *m.conv_window_states, *m.ssm_window_states]
        if m.prefix_cache is not None:
            pools += [*m.prefix_cache.conv, *m.prefix_cache.ssm]
        return pools

    def _kv_tensors(self) -> list[torch.Tensor]:
        return [*self.context.kv_caches, *self._state_tensors()]

    def tagged_bytes(self, tag: str) -> int:
        """Bytes of the tensors this engine knows under ``tag`` (graph pools not included)."""
        tensors = self._params() + self._buffers() if tag == WEIGHTS else self._kv_tensors()
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ checks
    def check_enabled(self) -> None:
        if self.backend is None:
            raise SuspendError("suspend is not enabled: build the engine with InferenceConfig(enable_suspend=True) "
                               "(CLI --enable-suspend)")

    def check_can_generate(self) -> None:
        if self.suspended:
            raise SuspendError(f"cannot generate while {sorted(self.suspended)} are suspended: resume them first")
        if self.weights_missing:
            raise SuspendError("the weights were dropped at suspend or left incomplete by a failed transfer: refill "
                               "them with update_weights first")

    def blocking_code(self, rank: int) -> int:
        """This rank's "cannot generate" state as one int for the per-step max-reduce (0: it can):
        the rank above the reason bits, so the max names the highest rank that cannot."""
        if not (self.suspended or self.weights_missing):  # every step's case: keep it cheap
            return 0
        bits = sum(_TAG_BITS[tag] for tag in self.suspended) | (_DROPPED if self.weights_missing else 0)
        return (rank + 1) << _REASON_BITS | bits

    def check_can_update_weights(self) -> None:
        if WEIGHTS in self.suspended:
            raise SuspendError("the weights are suspended: resume(('weights',)) before update_weights")

    def weights_updated(self) -> None:
        self.weights_missing = False

    # ------------------------------------------------------------------ suspend / resume
    def suspend(self, tags: Iterable[str], keep_weights_on_host: bool = True) -> None:
        self.check_enabled()
        tags = check_tags(tags)
        again = sorted(set(tags) & self.suspended)
        if again:
            raise SuspendError(f"{again} already suspended")
        if WEIGHTS in tags:
            self._suspend_weights(keep_weights_on_host)
        if KV_CACHE in tags:
            self._suspend_kv()

    def resume(self, tags: Iterable[str]) -> None:
        self.check_enabled()
        tags = check_tags(tags)
        missing = sorted(set(tags) - self.suspended)
        if missing:
            raise SuspendError(f"{missing} not suspended")
        if KV_CACHE in tags and WEIGHTS in self.suspended and WEIGHTS not in tags:
            raise SuspendError("resume(('weights',)) before (or together with) the KV cache")
        if KV_CACHE in tags and self.weights_missing:
            raise SuspendError("the weights were dropped at suspend: resume(('weights',)), update_weights(...), "
                               "then resume(('kv_cache',))")
        if WEIGHTS in tags:
            self._resume_weights()
        if KV_CACHE in tags:
            self._resume_kv()

    def _suspend_weights(self, keep: bool) -> None:
        params, buffers = self._params(), self._buffers()
        self._weights_host = [copy_to_host(p) for p in params] if keep else None
        self._buffers_host = [copy_to_host(b) for b in buffers]
        self._sync()
        self.backend.release(WEIGHTS, params + buffers)
        self.suspended.add(WEIGHTS)
        self.weights_missing = self.weights_missing or not keep

    def _resume_weights(self) -> None:
        params, buffers = self._params(), self._buffers()
        self.backend.restore(WEIGHTS, params + buffers)
        if self._weights_host is not None:
            for p, h in zip(params, self._weights_host):
                p.copy_(h, non_blocking=True)
        else:
            for p in params:
                p.zero_()
        for b, h in zip(buffers, self._buffers_host):
            b.copy_(h, non_blocking=True)
        self._sync()
        self._weights_host, self._buffers_host = None, []
        self.suspended.discard(WEIGHTS)

    def _suspend_kv(self) -> None:
        ctx = self.context
        active = list(ctx.active.values())
        dev = ctx.kv_caches[0].device if ctx.kv_caches else None
        blocks = sorted({b for r in active for b in r.block_ids})
        kept = _KeptKV(torch.tensor(blocks, dtype=torch.long))
        if blocks and ctx.kv_caches:
            idx = kept.blocks.to(dev)
            kept.kv = [copy_to_host(byte_view(t).index_select(1, idx)) for t in ctx.kv_caches]  # e4m3 as bytes
        m = ctx.mamba
        if m is not None:
            slots = sorted(r.state_slot for r in active if r.state_slot >= 0)
            kept.slots = torch.tensor(slots, dtype=torch.long)
            if slots:
                idx = kept.slots.to(m.conv_states[0].device)
                kept.states = [copy_to_host(t.index_select(0, idx)) for t in (*m.conv_states, *m.ssm_states)]
        self._sync()
        self.backend.release(KV_CACHE, self._kv_tensors())
        self._kept_kv = kept
        # Cached prefixes lose their blocks: re-key every block identity so none is hit again.
        ctx.weights_changed()
        self.suspended.add(KV_CACHE)

    def _resume_kv(self) -> None:
        ctx, kept = self.context, self._kept_kv
        tensors = self._kv_tensors()
        self.backend.restore(KV_CACHE, tensors)
        for t in tensors:
            t.zero_()
        if kept.kv:
            idx = kept.blocks.to(ctx.kv_caches[0].device)
            for t, h in zip(ctx.kv_caches, kept.kv):
                byte_view(t).index_copy_(1, idx, h.to(t.device, non_blocking=True))
        m = ctx.mamba
        if kept.states:
            idx = kept.slots.to(m.conv_states[0].device)
            for t, h in zip((*m.conv_states, *m.ssm_states), kept.states):
                t.index_copy_(0, idx, h.to(t.device, non_blocking=True))
        self._sync()
        self._kept_kv = None
        self.suspended.discard(KV_CACHE)

    def _sync(self) -> None:
        self.context.device.synchronize()
