"""What the scheduler hands the context for one step (rows in launch order), and what
data-parallel ranks agreed on for it."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_async.inference.request import DynamicInferenceRequest


@dataclass
class RowPlan:
    request: DynamicInferenceRequest
    start: int
    """First position this row computes."""
    num_tokens: int
    samples: bool
    """The row ends at the request's last known-or-in-flight token, so it samples the next one."""
    prev_row: int = -1
    """>= 0: the row's first input token is the previous launch's sample at that row (not yet on the CPU)."""
    num_drafts: int = 0
    """Speculative decoding: the row verifies this many draft tokens after its input token
    (``num_tokens == 1 + num_drafts``); the drafts are read on the device."""

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 + self.num_drafts and self.start >= len(self.request.prompt_tokens)


@dataclass
class StepPlan:
    rows: list[RowPlan] = field(default_factory=list)
    inflight_verified: bool = True
    """Speculative decoding: the launch in flight verified drafts, so rows continuing it
    (``prev_row`` >= 0) take their input token, and the correction of their positions, from
    the spec state on the device. False: it sampled one token per row, and they read its
    samples as a plain engine's rows do (speculative/plain_steps.py)."""
    decode_columns: tuple[list[int], list[int], list[int]] | None = None
    """The scheduler's plain decode pass: (start, prev_row, request's decode slot) of the plan's
    first rows, each one token that samples at the request's computed position with its KV
    place reserved. Covering every row (no chunk added after them) they let the snapshot skip
    its passes over the rows (contexts/decode_rows.py)."""

    @property
    def plain_decode(self) -> bool:
        """Every row came from the plain decode pass (``decode_columns``)."""
        return self.decode_columns is not None and len(self.decode_columns[0]) == len(self.rows) > 0

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def is_decode_only(self) -> bool:
        """Every row is one token that samples (the decode kernels and CUDA graphs need this)."""
        if self.plain_decode:
            return True
        return bool(self.rows) and all(r.num_tokens == 1 and r.samples for r in self.rows)

    @property
    def is_all_decode(self) -> bool:
        """Every row is a decode row, verify rows (one token plus drafts) included."""
        if self.plain_decode:
            return True
        return bool(self.rows) and all(r.samples and r.num_tokens == 1 + r.num_drafts for r in self.rows)

    def __bool__(self) -> bool:
        return bool(self.rows)


@dataclass(frozen=True)
class StepAgreement:
    """What data-parallel ranks agreed on for one step (step_consensus.py), handed to the model
    runner with the step; the default is a rank on its own."""

    max_tokens: int = 0
    """The most tokens any rank launches in this step: what MoE exchanges (and padded decode
    graphs) pad to."""
    eager: bool = False
    """Some rank cannot replay a graph in this step: none does."""
    variant: int = 0
    """The sampling variant every rank replays in this step (the largest any rank needs)."""


ALONE = StepAgreement()
