"""Launch-ahead state: what a launched-but-not-bookkept step assumed.

A ``PendingLaunch`` records the row order the device computes for, which rows sample, and
where their results will land on the host. When step N's bookkeeping finishes requests
that also have a row in the in-flight step N+1, those rows' results are simply dropped
(``RequestBook.land`` reconciles: a row of a FINISHED request is discarded): the speculative
token of a finished request is never appended, and its KV slot belongs to blocks the request
already gave back (stream order makes reuse safe). Rows of live requests (paused and evicted
ones too) are kept. Pause/evict decisions are taken at scheduling time and never touch a
launched row, so no launch needs rolling back."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_async.inference.engines.step_plan import RowPlan


@dataclass
class PendingLaunch:
    step_id: int
    rows: list[RowPlan]
    is_decode_only: bool
    """Every row is a decode row (verify rows with drafts included)."""
    num_tokens: int
    overlapped: bool
    """Launched while an earlier launch was still un-bookkept."""
    host_tokens: torch.Tensor
    """Host (pinned on CUDA) int64 [R] the sampled tokens land in."""
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
    weight_version: int = 0
    """The weights this launch ran with (set when launched: a weight update enqueued after it
    runs after it on the device), recorded on the tokens it lands."""
    prompt_scoring: object | None = None
    """Rows scoring their prompt: their host copies (``PromptScoring``; None for most steps)."""

    @property
    def request_ids(self) -> list[int]:
        return [r.request.request_id for r in self.rows]
