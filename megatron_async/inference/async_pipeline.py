"""Launch-ahead state: what a launched-but-not-bookkept step assumed.

A ``PendingLaunch`` records the row order the device computes for, which rows sample, and
where their results will land on the host. When step N's bookkeeping finishes requests
that also have a row in the in-flight step N+1, those rows' results are simply dropped
(``RequestBook.land`` reconciles: a row of a FINISHED request is discarded): the speculative
token of a finished request is never appended, and its KV slot belongs to blocks the request
already gave back (stream order makes reuse safe). Rows of live requests (paused and evicted
ones too) are kept. Pause/evict decisions are taken at scheduling time and never touch a
launched row, so no launch needs rolling back. ``HostSamples`` is what a launch brings back
when it lands."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from megatron_async.inference.step_plan import RowPlan


@dataclass
class PendingLaunch:
    step_id: int
    rows: list[RowPlan]
    is_decode_only: bool
    """Every row is a decode row (verify rows with drafts included)."""
    num_tokens: int
    overlapped: bool
    """Launched while an earlier launch was still un-bookkept."""
    host_tokens: torch.Tensor | None
    """Host (pinned on CUDA) int64 [R] the sampled tokens land in (None while ``awaiting_masks``)."""
    host_log_probs: torch.Tensor | None
    host_top_n_vals: torch.Tensor | None
    host_top_n_ids: torch.Tensor | None
    event: object | None
    """Recorded after the D2H copies; None on CPU (results are ready at once)."""
    launch_time: float = 0.0
    timing_events: tuple = ()
    discarded_rows: list[int] = field(default_factory=list)
    host_accepted: torch.Tensor | None = None
    """Speculative decoding: host int64 [R] drafts accepted per row (same event as the tokens)."""
    sample_base: list[int] | None = None
    """Speculative decoding: each row's first sample in ``host_tokens`` (None: sample i is row i)."""
    routed_experts: object | None = None
    """Routing replay: the launch's ``routed_experts.StepRouting`` (None: no row asked)."""
    weight_version: int = 0
    """The weights this launch ran with (set when launched: a weight update enqueued after it
    runs after it on the device), recorded on the tokens it lands."""
    prompt_scoring: object | None = None
    """Rows scoring their prompt: their host copies (``PromptScoring``; None for most steps)."""
    awaiting_masks: object | None = None
    """A launch with grammar rows whose forward is enqueued and whose sampling waits for the
    host's token masks (``ModelRunner.finish_launch`` enqueues it and clears this)."""

    @property
    def request_ids(self) -> list[int]:
        return [r.request.request_id for r in self.rows]


class PromptRowScores(NamedTuple):
    """One launch row's scored prompt positions (``SamplingParams.return_prompt_log_probs``)."""

    row: int
    """The row of the launch."""
    start: int
    """Its first scored position p (entry p: log P(prompt[p + 1] | prompt[:p + 1]))."""
    log_probs: list[float]
    top_n_ids: list[list[int]] | None
    top_n_vals: list[list[float]] | None


@dataclass
class HostSamples:
    """What a landed launch brought to the host, as plain Python lists (``ModelRunner.collect``)."""

    tokens: list[int]
    """Sample i's token (row i's without drafts; ``PendingLaunch.sample_base`` maps rows to samples)."""
    log_probs: list[float] | None
    top_n_ids: list[list[int]] | None
    top_n_vals: list[list[float]] | None
    accepted: list[int] | None
    """Speculative decoding: drafts accepted per row (None: a step that verified nothing)."""
    step_time: float | None
    """Device time of the step, on timed (logging) steps only; host time on CPU."""
    prompt_scores: list[PromptRowScores] | None = None
    """Rows that scored prompt positions (``return_prompt_log_probs``)."""
    routed_experts: object | None = None
    """Routing replay: ``routed_experts.StepRouting`` of the rows that asked (None: none did)."""
