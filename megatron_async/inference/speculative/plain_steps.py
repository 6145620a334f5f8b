"""Which steps of a speculative engine run the plain engine's step (speculation must
cost nothing where it does not draft).

A step (decode rows, prefill chunks or both) needs the speculative machinery only for
- rows with drafts (their verification and acceptance);
- rows continuing a launch in flight that verified drafts: their input token and positions
  come from the spec state, corrected on the device by that launch's shortfall;
- a next step in which some row may draft: drafts come from the drafter's run in the
  request's previous launch.
Every other step runs what a plain engine runs and replays its graphs (decode graphs, and
mixed graphs for steps with prefill chunks): no gather from the spec state, no acceptance, no
Mamba commit, no drafter (drafters with per-position state follow the step through
``Drafter.track``: the n-gram history takes a prompt's first sample, MTP's depth 0 its chunk's
hidden states). The rows of a plain step read their predecessor's samples as plain rows do
(``StepPlan.inflight_verified``), and a request whose latest launch was plain drafts nothing in
its next row (the policy's ``spec_drafts_fresh`` check), so a stale draft is never verified; a
wrong guess of ``SpecPolicy.may_any_draft_next`` costs time, never a token. Under the adaptive
rule a step whose next step carries prefill chunks (which draft nothing) is plain unless its
own rows need the machinery: the prefill steps of a batch that arrives at once replay the
plain engine's mixed graphs."""
from __future__ import annotations

from megatron_async.inference.speculative.policy import SpecPolicy
from megatron_async.inference.step_plan import StepPlan


class PlainStepSelector:
    def __init__(self, policy: SpecPolicy | None = None):
        """``policy``: the scheduler's (None: every step runs the speculative machinery)."""
        self.policy = policy
        self.inflight_verified = False
        """The latest launch verified drafts (some row had drafts)."""
        self.plain_steps = 0
        """Decode steps launched as plain steps."""
        self.plain_mixed_steps = 0
        """Steps with prefill chunks launched as plain steps."""

    def speculative(self, plan: StepPlan) -> bool:
        """Whether ``plan``'s step runs the speculative machinery; also tells the plan where its
        continuing rows read their input (call before assembling the step)."""
        plan.inflight_verified = self.inflight_verified
        rows = plan.rows
        if self.policy is None or any(r.num_drafts for r in rows):
            return True
        if self.inflight_verified and any(r.prev_row >= 0 for r in rows):
            return True
        return self.policy.may_any_draft_next([r.request for r in rows if r.samples])

    def launched(self, plan: StepPlan, speculative: bool, decode_only: bool) -> None:
        """``plan``'s step was launched (``speculative``: with the drafter; the request book
        marks its rows' drafts fresh or stale, ``RequestBook.commit``; ``decode_only``: one
        token a row)."""
        self.inflight_verified = speculative and any(r.num_drafts for r in plan.rows)
        if not speculative:
            self.plain_steps += decode_only
            self.plain_mixed_steps += not decode_only
