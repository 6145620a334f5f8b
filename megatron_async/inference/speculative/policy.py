"""How many drafts a decode row verifies: speculation switches itself off where it does not pay.

Host-side and cheap: the scheduler asks once per decode row. A request's acceptance is a
moving average of accepted / drafted over its bookkept verify rows (a row weighs as many
drafts as it verified); below ``speculative_min_acceptance`` the request decodes plainly and
probes with one draft every ``speculative_probe_interval`` steps. The probes of all
switched-off requests fall on the same steps (a step clock, not a per-request count): one
probing row makes the whole step a verify step (a verify graph pads every row to 2 tokens),
so staggered probes made every step of a large batch a verify step (batch 128, 0 %
acceptance: 0.47x plain decode with graphs). Steps with more decode rows than
``speculative_max_batch_size`` run plainly (verify work grows with the batch while the
saving does not). Requests with penalties or ``min_tokens`` never draft: their device token
counts advance by every sample of a row, rejected ones included. Every row that could have
drafted but did not is counted by cause (EngineStats reads these counters).

A request starts from the engine's recent acceptance (``recent_acceptance``: the same kind of
average over every request's verify rows, slower; 1.0 before any), not from 1.0: at 0 %
acceptance each new request would otherwise pay 2-4 wide verify rows before switching off,
and a batch of them as many wide verify steps (batch 128 / 0 %). A request that
starts switched off drafts from its first probe on if drafts land.

Drafts for a row come from the drafter's run in the request's previous launch. A decode step
after which no row can draft runs the plain engine's step, drafter and spec state untouched
(``may_any_draft_next`` guesses; plain_steps.py decides the step): a request whose latest
launch was such a step has no drafts for its next row (``spec_drafts_fresh`` False) and
decodes that row plainly, counted as "stale"; that row's step runs the drafter again."""
from __future__ import annotations

from collections import Counter

from megatron_async.config import Speculation
from megatron_async.inference.request import DynamicInferenceRequest

_EMA = 0.25  # weight of the newest draft in a request's acceptance average
_ENGINE_EMA = 1 / 16  # in the engine average (new requests start from it): ~40 rejected drafts take it from 1 to 0.1


class SpecPolicy:
    def __init__(self, config: Speculation):
        self.k = config.num_speculative_tokens
        self.min_acceptance = config.speculative_min_acceptance
        self.probe_interval = config.speculative_probe_interval
        self.max_batch = config.speculative_max_batch_size
        self.recent_acceptance = 1.0
        """Acceptance average over every request's verify rows (weighted per draft, as
        ``observe``): where a new request's ``spec_acceptance`` starts (``admit``)."""
        self.step = 0
        """Steps scheduled so far: switched-off requests probe when it is a multiple of the interval."""
        self.off_rows: Counter = Counter()
        """Decode rows run without drafts, by cause: "penalties", "batch", "acceptance", "stale"."""

    @property
    def enabled(self) -> bool:
        return self.k > 0

    def begin_step(self) -> None:
        self.step += 1

    def drafts_for(self, req: DynamicInferenceRequest, num_decode_rows: int, room: int) -> int:
        """Drafts for ``req``'s next decode row; ``room``: the most its length limits and the
        step's token budget allow."""
        if self.k == 0 or room <= 0:
            return 0
        if req.sampling_params.has_penalties:
            self.off_rows["penalties"] += 1
            return 0
        if self.max_batch and num_decode_rows > self.max_batch:
            self.off_rows["batch"] += 1
            return 0
        if req.spec_acceptance < self.min_acceptance:
            if self.step % self.probe_interval:
                self.off_rows["acceptance"] += 1
                return 0
            return self._fresh(req, 1)  # probe: one draft tells whether drafts land again, at the least cost
        return self._fresh(req, min(self.k, room))

    def _fresh(self, req: DynamicInferenceRequest, drafts: int) -> int:
        if req.spec_drafts_fresh:
            return drafts
        self.off_rows["stale"] += 1  # its latest launch ran without the drafter: nothing to verify
        return 0

    def may_any_draft_next(self, requests: list[DynamicInferenceRequest]) -> bool:
        """Could a row of ``requests`` (the decode rows of the step being launched) draft in
        the next step? A guess from what is known now (the next step's rows as these), for
        deciding whether this step runs the drafter: wrong only in cost (a wasted drafter run,
        or a row decoded plainly as "stale"), never in tokens: ``drafts_for`` checks
        ``spec_drafts_fresh``."""
        if self.k == 0 or self.max_batch and len(requests) > self.max_batch:
            return False
        probe = (self.step + 1) % self.probe_interval == 0
        m = self.min_acceptance
        return any((probe or req.spec_acceptance >= m) and not req.sampling_params.has_penalties for req in requests)

    def admit(self, req: DynamicInferenceRequest) -> None:
        """A new request (not a recompute after eviction) starts from the engine's recent acceptance."""
        req.spec_acceptance = self.recent_acceptance

    def observe(self, req: DynamicInferenceRequest, drafted: int, accepted: int) -> None:
        """Fold one bookkept verify row into the request's acceptance average, weighted as its
        ``drafted`` drafts one by one: a row of k rejected drafts is k pieces of evidence (at
        k = 3 and 0 % acceptance a request switches off after 2 verify rows instead of 5, each
        of which costs a (k + 1)-token row), a probe one; and into the engine's average."""
        if drafted > 0:
            rate = accepted / drafted
            req.spec_acceptance += (1.0 - (1.0 - _EMA) ** drafted) * (rate - req.spec_acceptance)
            self.recent_acceptance += (1.0 - (1.0 - _ENGINE_EMA) ** drafted) * (rate - self.recent_acceptance)
