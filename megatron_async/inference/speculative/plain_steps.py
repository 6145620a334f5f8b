"""Which steps of a speculative engine run the plain engine's step (speculation must
cost nothing where it does not draft).

A decode step needs the speculative machinery only for
- rows with drafts (their verification and acceptance);
- rows continuing a launch in flight that verified drafts: their input token and positions
  come from the spec state, corrected on the device by that launch's shortfall;
- a next step in which some row may draft: drafts come from the drafter's run in the
  request's previous launch.
Every other step (decode rows only, one token each) runs what a plain engine runs and replays
its decode graphs: no gather from the spec state, no acceptance, no Mamba commit, no drafter
(drafters with per-position state follow the step through ``Drafter.track``). The rows of a
plain step read their predecessor's samples as plain rows do (``StepPlan.inflight_verified``),
and a request whose latest launch was plain drafts nothing in its next row (the policy's
``spec_drafts_fresh`` check), so a stale draft is never verified; a wrong guess of
``SpecPolicy.may_draft_next`` costs time, never a token."""
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

    def speculative(self, plan: StepPlan) -> bool:
        """Whether ``plan``'s step runs the speculative machinery; also tells the plan where its
        continuing rows read their input (call before assembling the step)."""
        plan.inflight_verified = self.inflight_verified
        if self.policy is None or not plan.is_decode_only:
            return True  # drafts in some row, or prefill chunks: the drafter fills its state
        rows = plan.rows
        if self.inflight_verified and any(r.prev_row >= 0 for r in rows):
            return True
        return self.policy.may_any_draft_next([r.request for r in rows])

    def launched(self, plan: StepPlan, speculative: bool) -> None:
        """``plan``'s step was launched (``speculative``: with the drafter; the request book
        marks its rows' drafts fresh or stale, ``RequestBook.commit``)."""
        self.inflight_verified = speculative and any(r.num_drafts for r in plan.rows)
        self.plain_steps += not speculative
