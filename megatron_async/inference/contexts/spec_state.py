"""Per-request device state of speculative decoding: one slot per active request.

Under launch-ahead the host schedules step N+1 before it knows how many drafts step N
accepted, so everything a verify row needs from its predecessor lives here, on the device,
written by step N and read by step N+1 (fixed addresses, graph-safe):

- ``last_token[s]``: the request's newest emitted token (the next row's input token);
- ``last_pos[s]``: that token's position;
- ``shortfall[s]``: drafts the latest launch rejected (``num_drafts - accepted``): the host
  assumed full acceptance, so the next row's positions are that many too far;
- ``drafts[s, :K]``: the drafter's proposal after the latest launch (the next row's drafts).

A slot is assigned at admission (the drafter fills its own per-slot state from the host's
tokens then) and freed at release / eviction; rows that sample nothing, and padding rows,
point at the extra padding slot, whose contents are never read for a real row."""
from __future__ import annotations

from typing import Protocol

import torch

from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.request import DynamicInferenceRequest


class SlotDrafter(Protocol):
    """What the slots need of the engine's drafter (a ``speculative.drafter.Drafter``: the
    drafters sit above the contexts, which never import them): per-slot state allocated once,
    then filled whenever a request gets a slot."""

    def bind(self, spec: SpecState) -> None: ...

    def on_admit(self, req: DynamicInferenceRequest, slot: int) -> None: ...


class SpecState:
    def __init__(self, max_requests: int, num_speculative_tokens: int, device: DeviceFacade):
        self.num_speculative_tokens = K = num_speculative_tokens
        self.padding_slot = max_requests
        self.device = device
        dev = device.device
        n = max_requests + 1
        self.last_token = torch.zeros(n, dtype=torch.int64, device=dev)
        self.last_pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.shortfall = torch.zeros(n, dtype=torch.int64, device=dev)
        self.drafts = torch.zeros(n, K, dtype=torch.int64, device=dev)
        self._free = list(range(max_requests - 1, -1, -1))
        self.drafter: SlotDrafter | None = None

    @property
    def num_slots(self) -> int:
        """Slots including the padding slot (the drafters size their per-slot state by it)."""
        return self.padding_slot + 1

    def set_drafter(self, drafter: SlotDrafter) -> None:
        drafter.bind(self)
        self.drafter = drafter

    def assign(self, req: DynamicInferenceRequest) -> None:
        """Give ``req`` a slot and let the drafter fill its state from the known tokens
        (prompt, plus generated tokens when it is recomputed after an eviction)."""
        if req.spec_slot >= 0:
            return
        req.spec_slot = self._free.pop()
        req.spec_drafts_fresh = False  # the slot's drafts are another request's until a drafter run
        if self.drafter is not None:
            self.drafter.on_admit(req, req.spec_slot)

    def free(self, req: DynamicInferenceRequest) -> None:
        if req.spec_slot >= 0:
            self._free.append(req.spec_slot)
            req.spec_slot = -1
