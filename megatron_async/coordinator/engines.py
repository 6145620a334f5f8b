"""The engines a coordinator knows: registration, drain, leave and death, and the routing key
space they share.

An engine registers with what routing needs (its request slots, its KV capacity in blocks, its
block size, the key its prefix cache roots block identities in, whether it caches prefixes) and
gets the next index: registration order, which every routing tie goes to. It takes requests at
once. ``drain`` stops routing to it; once its last request ended it leaves (``remove``). A dead
engine is removed the same way; what happens to its requests is the request table's business
(requests.py).

Key space: the coordinator routes on the keys of one ``hash_key`` (the engines'; it changes
with their weights). An engine whose key differs (its weights were updated, the others' not yet)
is placed by load only until they agree again; the view of its cache is forgotten whenever its
key changes (its old blocks are never hit again)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from megatron_async.inference.dp_routing import PrefixView


ROLES = ("mixed", "prefill", "decode")
"""An engine's part (docs/DISAGGREGATION.md): "mixed" computes prompts and decodes them; "prefill"
computes prompts and hands each request to a "decode" engine after its first token."""


class EngineState(str, Enum):
    ACTIVE = "active"  # takes new requests
    DRAINING = "draining"  # finishes its requests, takes no new ones, then leaves
    GONE = "gone"  # left or died


class RegistrationError(ValueError):
    """An engine that cannot join this coordinator's engines (another block size)."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine says about itself when it registers."""

    name: str
    max_requests: int
    capacity_blocks: int
    block_size: int
    hash_key: bytes
    prefix_caching: bool
    role: str = "mixed"
    kv_address: str = ""
    """A decode engine's store of transfer rendezvous ("host:port"; "" for the others)."""
    kv_backend: str = "gloo"
    """How it moves KV blocks (``InferenceConfig.kv_transfer_backend`` resolved on its device)."""
    loras: tuple[str, ...] = ()
    """The LoRA adapters it holds when it registers (``--lora-modules``; docs/LORA.md)."""


@dataclass(eq=False)
class EngineSlot:
    index: int
    info: EngineInfo
    peer: Any = None
    """The transport's key of its connection (hashable)."""
    pending: int = 0
    """Requests routed to it and not yet ended."""
    state: EngineState = EngineState.ACTIVE
    hash_key: bytes = b""
    affinity: bool = True
    """Its cache is in the coordinator's key space and caches prefixes: routing reads its view."""
    submitted: int = 0
    """Submissions sent to it (each carries its number: eviction reports say up to which one they saw)."""
    last_heard: float = field(default_factory=time.monotonic)
    load: int = 0
    """Unfinished requests it reported last (its own count, aborted ones it still steps included)."""
    free_blocks: int = 0
    """KV blocks it could hand out when it last said (free plus reclaimable cached ones)."""
    kv_sent_blocks: int = 0
    kv_received_blocks: int = 0
    """KV blocks of hand-offs it sent / imported (counted at the decode engine's confirmation)."""
    loras: set[str] = field(default_factory=set)
    """The LoRA adapters a request may be routed to it for (coordinator/adapters.py)."""

    def __post_init__(self):
        self.loras = set(self.loras or self.info.loras)

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def max_requests(self) -> int:
        return self.info.max_requests

    @property
    def name(self) -> str:
        return self.info.name


class EngineTable:
    def __init__(self, view: PrefixView):
        self.view = view
        self.slots: dict[int, EngineSlot] = {}
        self._next_index = 0
        self.block_size: int | None = None
        self.hash_key: bytes | None = None
        self.key_epoch = 0
        """Bumped whenever ``hash_key`` changes (clients that hash prompts themselves say which
        key they used; the coordinator re-hashes for a stale one)."""

    def register(self, info: EngineInfo, peer: Any = None) -> EngineSlot:
        if info.max_requests < 1 or info.block_size < 1:
            raise RegistrationError(f"engine {info.name}: max_requests and block_size must be positive")
        if self.block_size is not None and info.block_size != self.block_size:
            raise RegistrationError(f"engine {info.name} has KV blocks of {info.block_size} tokens, the engines "
                                    f"registered here {self.block_size}: one coordinator routes for one model setup")
        self.block_size = info.block_size
        slot = EngineSlot(self._next_index, info, peer, hash_key=info.hash_key)
        self._next_index += 1
        self.slots[slot.index] = slot
        self.view.add_engine(slot.index, info.capacity_blocks)
        if self.hash_key is None:
            self._set_key(info.hash_key)
        self._update_affinity(slot)
        return slot

    def _set_key(self, key: bytes) -> None:
        self.hash_key = key
        self.key_epoch += 1
        for s in self.slots.values():
            self._update_affinity(s)

    def _update_affinity(self, slot: EngineSlot) -> None:
        slot.affinity = slot.info.prefix_caching and slot.hash_key == self.hash_key

    def key_changed(self, slot: EngineSlot, key: bytes) -> bool:
        """``slot``'s cache is keyed by ``key`` from now on. True when the coordinator's key
        space moved with it (clients are told)."""
        if key == slot.hash_key:
            return False
        slot.hash_key = key
        if slot.state is not EngineState.GONE:
            self.view.reset_engine(slot.index)
        moved = key != self.hash_key
        if moved:
            self._set_key(key)  # the newest weights: the others follow when their update reaches them
        self._update_affinity(slot)
        return moved

    def routable(self) -> list[EngineSlot]:
        """Engines that take new requests (every role but "decode"), by index."""
        return [s for s in self.slots.values() if s.state is EngineState.ACTIVE and s.info.role != "decode"]

    def decoders(self) -> list[EngineSlot]:
        """Decode engines that take hand-offs, by index."""
        return [s for s in self.slots.values() if s.state is EngineState.ACTIVE and s.info.role == "decode"]

    def live(self) -> list[EngineSlot]:
        """Engines that are connected (active or draining), by index."""
        return [s for s in self.slots.values() if s.state is not EngineState.GONE]

    def drain(self, index: int) -> EngineSlot | None:
        slot = self.slots.get(index)
        if slot is None or slot.state is EngineState.GONE:
            return None
        slot.state = EngineState.DRAINING
        return slot

    def remove(self, slot: EngineSlot) -> None:
        """It left or died: forgotten (its index is never reused)."""
        slot.state = EngineState.GONE
        self.slots.pop(slot.index, None)
        self.view.forget_engine(slot.index)

    def describe(self) -> list[dict]:
        """The engines as plain values (what a client's ``engines()`` gets)."""
        return [{"index": s.index, "name": s.name, "state": s.state.value, "pending": s.pending, "load": s.load,
                 "max_requests": s.max_requests, "affinity": s.affinity, "cached_keys": self.view.num_keys(s.index),
                 "free_blocks": s.free_blocks, "capacity_blocks": s.info.capacity_blocks, "submitted": s.submitted,
                 "role": s.role, "kv_sent_blocks": s.kv_sent_blocks, "kv_received_blocks": s.kv_received_blocks,
                 "loras": sorted(s.loras)}
                for s in self.slots.values()]
