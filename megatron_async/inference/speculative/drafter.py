"""The drafter interface: draft tokens are produced ON THE DEVICE from a step's outputs.

After every launch (verify rows and plain rows alike) the engine calls ``propose`` with the
step's ``VerifyOutputs``; the drafts it returns are stored in ``SpecState.drafts`` at the
rows' slots and gathered as input ids by the request's next row. Under launch-ahead that
next row is already being launched while the host has not seen this step's samples, so a
drafter must never read device values on the host (no ``.item()`` / ``.tolist()``): only
tensor ops on the device, with shapes fixed by the step (graph-safe).

A drafter may keep per-request device state (token history, hidden states, KV of its own
layers) indexed by the request's spec slot: ``on_admit`` fills it from the host's tokens
when a request is admitted or re-admitted after an eviction (a small H2D copy, like the
penalty state's), and every ``propose`` advances it from the step's outputs. How to plug in
a new drafter: docs/SPECULATIVE.md."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_async.forward_batch import ForwardBatch
    from megatron_async.inference.contexts.spec_state import SpecState
    from megatron_async.inference.device import DeviceFacade
    from megatron_async.inference.request import DynamicInferenceRequest


@dataclass
class VerifyOutputs:
    """What one launch leaves for the drafter; every tensor is on the device, one entry per
    row of the step (R = ``num_rows``, K = num_speculative_tokens, T = the step's tokens).

    Row r verified ``num_drafts[r]`` drafts and kept ``accepted[r]`` of them; its emitted tokens
    are ``tokens[r, :accepted[r] + 1]`` at positions ``positions[r, :accepted[r] + 1]`` (entries
    past ``num_drafts[r]`` repeat the row's last sample). Rows that sample nothing (a prefill
    chunk that is not the prompt's last) have ``slots[r] == SpecState.padding_slot``: a drafter
    may compute garbage for them, it lands in the padding slot."""

    num_rows: int
    slots: torch.Tensor
    """[R] int64: spec slot of each row."""
    tokens: torch.Tensor
    """[R, K + 1] int64: the tokens the model sampled at the row's positions."""
    positions: torch.Tensor
    """[R, K + 1] int64: the position each of those tokens occupies in its sequence."""
    num_drafts: torch.Tensor
    """[R] int64: drafts the row verified (0: a plain row)."""
    accepted: torch.Tensor
    """[R] int64: drafts accepted (<= num_drafts)."""
    last_token: torch.Tensor
    """[R] int64: the row's newest emitted token (``tokens[r, accepted[r]]``): the bonus token."""
    last_pos: torch.Tensor
    """[R] int64: its position."""
    hidden: torch.Tensor
    """[T, H]: the model's final hidden states of the step (output of ``model.forward``)."""
    hidden_idx: torch.Tensor
    """[R] int64: row of ``hidden`` whose logits produced ``last_token`` (MTP's input state)."""
    batch: ForwardBatch
    """The step's attention metadata (positions already corrected on the device)."""
    row_slots: torch.Tensor | None = None
    """[R] int64: spec slot of each row's request, also for rows that sample nothing (where
    ``slots`` is the padding slot): for drafters that read per-request state at every
    position the step processed (MTP: the token after each position)."""


class Drafter(ABC):
    """Proposes ``num_speculative_tokens`` drafts per row, on the device."""

    name: str = "drafter"
    tracks_plain_steps: bool = False
    """``track`` must see the steps a speculative engine runs without the drafter (plain_steps.py)."""

    def bind(self, spec: SpecState) -> None:
        """Called once when the engine is built: allocate per-slot device state here
        (``spec.num_slots`` rows, ``spec.num_speculative_tokens`` drafts, ``spec.device``)."""
        self.spec = spec

    def on_admit(self, req: DynamicInferenceRequest, slot: int) -> None:
        """A request got ``slot``: its known tokens are ``req.prompt_tokens + req.generated_tokens``."""

    @abstractmethod
    def propose(self, out: VerifyOutputs) -> torch.Tensor:
        """-> [R, K] int64 drafts for each row's next step (positions ``last_pos + 1 ...``)."""

    def track(self, out: VerifyOutputs) -> None:
        """A step ran without the drafter (no drafts in it, none wanted after it: plain_steps.py):
        update per-position state its later proposals read (token history, a head's KV), so
        drafting resumes as if it had run. ``out`` has one sample per row (``num_drafts`` 0),
        every tensor on the device, as in ``propose``; nothing may be read on the host. Called
        only when ``tracks_plain_steps``."""

    def match_collectives(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> None:
        """Data-parallel engines (expert parallelism): a rank with nothing to launch runs this
        after its dummy forward (``input_ids`` / ``hidden`` of its padding rows, ``batch`` with
        the agreed ``ep_num_tokens``), so that every collective ``propose`` runs on the ranks
        that launched (MoE token exchanges of a drafter's own layers) has its partner here.
        Drafters without model layers run none (the default)."""


def upload(values: list[int], device: DeviceFacade) -> torch.Tensor:
    """Host ints to an int64 device tensor without a host sync: a copy from pageable memory
    may wait for the stream (a stall of launch-ahead at every admission), so on CUDA the values
    go through pinned memory (the caching host allocator keeps the block until the copy is done)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.is_cuda:
        host = host.pin_memory()
    return host.to(device.device, non_blocking=True)


class TokenHistory:
    """Each request's known tokens (prompt + emitted) in a device row of its spec slot, for
    drafters that read a request's earlier tokens (n-gram lookup, MTP's next-token inputs)."""

    def __init__(self, spec: SpecState, max_sequence_length: int):
        # a row writes up to K + 1 positions past its last one (samples of rejected drafts too)
        self.length = max_sequence_length + spec.num_speculative_tokens + 2
        self.tokens = torch.zeros(spec.num_slots, self.length, dtype=torch.int64, device=spec.device.device)
        self.device = spec.device

    def fill(self, req: DynamicInferenceRequest, slot: int) -> None:
        """``Drafter.on_admit``: the host's tokens of a (re-)admitted request."""
        known = req.prompt_tokens + req.generated_tokens
        self.tokens[slot, : len(known)] = upload(known, self.device)

    def record(self, out: VerifyOutputs) -> None:
        """Write the step's samples at their positions (those past the accepted run are
        overwritten by later steps, like rejected KV)."""
        pos = out.positions.clamp(0, self.length - 1)
        self.tokens[out.slots[:, None].expand_as(pos), pos] = out.tokens

