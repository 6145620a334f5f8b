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
counts advance by every sample of a row, rejected ones included; nor do requests with a grammar
(structured outputs): their masks come from the host, one per row. Every row that could have
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
decodes that row plainly, counted as "stale"; that row's step runs the drafter again.

Adaptive mode (``speculative_adaptive``, on for CUDA): before a step's decode rows draft,
``plan_step`` caps the drafts of every row of the step by what pays at this batch size. With B
decode rows and a row's acceptance a (its moving average; a probe row counts one draft), a
verify step of width W (its widest row W - 1 drafts; rows are padded to the width) brings
G(W) = mean over rows of 1 + a + ... + a^(W-1) tokens per row (a: the per-position acceptance;
the switch-off by ``speculative_min_acceptance`` and its probes do not apply: the step's rule
turns drafting off, and its retries probe), and costs R(B, W) = cost(B, W) /
cost(B, 1) plain steps, both costs measured (step_cost.py: the wall time of landed steps per
batch bucket and width). The step verifies at the width (of the verify graphs' widths) with the
largest G(W) / R(B, W) above 1 (every row drafting up to W - 1), else runs without drafts
(counted as "cost"). Unmeasured costs
are found by trying: the first decode step of a batch bucket runs plain; a width whose cost
ratio is unknown is tried once when G(W) exceeds the lower bound of R that smaller buckets and
narrower widths give (R grows with the batch and the width), narrow widths before wide ones. A
measured width that loses is tried again after (R - 1) / 0.005 steps (at least 64, at most
4,096: the retry costs under 0.5 %), and a plain step is measured again every 256 steps. So at
a batch where a verify step costs more than its accepted tokens bring, speculation costs one or
two trial steps per bucket, and where it pays it runs at the width that pays most; no batch
threshold is involved. Tokens never depend on the choice (drafts only ever save steps)."""
from __future__ import annotations

from collections import Counter

from megatron_async.config import Speculation
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.inference.speculative.step_cost import StepCosts

_EMA = 0.25  # weight of the newest draft in a request's acceptance average
_ENGINE_EMA = 1 / 16  # in the engine average (new requests start from it): ~40 rejected drafts take it from 1 to 0.1
_ENGINE_POSITION_EMA = 1 / 64  # adaptive mode, per verify row: a batch of 16 rows moves it by a fifth
_PLAIN_MAX_AGE = 256  # steps after which a bucket's plain step cost is measured again
_RETRY_LOSS = 0.005  # a losing width is tried again after (R - 1) / this many steps


def _position_update(a: float, accepted: int, tried: int, drafted: int, weight: float) -> float:
    """One verify row into a per-position acceptance average: a += weight * (accepted - a *
    tried) / E[tried]. With each tried position accepted at rate a, E[accepted] = a E[tried],
    so the average settles at the true rate whatever the row lengths (averaging the positions
    one by one would end every short row on its rejection and settle low)."""
    expected = sum(a ** i for i in range(drafted))  # positions a row of `drafted` drafts tries
    return min(1.0, max(0.0, a + weight * (accepted - a * tried) / max(expected, 1e-6)))


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
        """Decode rows run without drafts, by cause: "penalties", "grammar", "batch", "acceptance", "cost", "stale"."""
        self.adaptive = bool(config.speculative_adaptive) and self.k > 0
        K = self.k
        self.widths = sorted({w for w in (config.cuda_graph_verify_widths or (2, K + 1)) if 2 <= w <= K + 1}
                             | {K + 1}) if K else []
        """Verify widths the step may choose (the verify graphs' widths)."""
        self.costs = StepCosts()
        self.step_cap = K
        """Drafts a row of the step being scheduled may verify at most (``plan_step``)."""

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
        if req.sampling_params.structured_outputs is not None:
            self.off_rows["grammar"] += 1
            return 0
        if req.banned_sequences:  # its bans follow its newest tokens, one at a time
            self.off_rows["bad_words"] += 1
            return 0
        if self.max_batch and num_decode_rows > self.max_batch:
            self.off_rows["batch"] += 1
            return 0
        if req.spec_acceptance < self.min_acceptance and not self.adaptive:
            if self.step % self.probe_interval:
                self.off_rows["acceptance"] += 1
                return 0
            drafts = 1  # probe: one draft tells whether drafts land again, at the least cost
        else:
            drafts = min(self.k, room)
        if self.step_cap == 0:
            self.off_rows["cost"] += 1
            return 0
        return self._fresh(req, min(drafts, self.step_cap))

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
        if self.adaptive:
            return self.choose_cap(requests, self.step + 1) > 0 and any(
                not _never_drafts(req) for req in requests)
        probe = (self.step + 1) % self.probe_interval == 0
        m = self.min_acceptance
        return any((probe or req.spec_acceptance >= m) and not _never_drafts(req) for req in requests)

    def plan_step(self, requests: list[DynamicInferenceRequest]) -> None:
        """The step being scheduled has ``requests`` as its decode rows: set ``step_cap``."""
        self.step_cap = self.choose_cap(requests, self.step) if self.adaptive else self.k

    def _row_drafts(self, req: DynamicInferenceRequest, probe: bool) -> int:
        """Drafts ``req`` would verify at most in a step (0: none, whatever the width)."""
        if _never_drafts(req):
            return 0
        if req.spec_acceptance < self.min_acceptance and not self.adaptive:
            return 1 if probe else 0
        return self.k

    def gain(self, requests: list[DynamicInferenceRequest], width: int, step: int) -> float:
        """G(W): expected tokens per row of a verify step of ``width`` (1 + a + ... per row)."""
        probe = step % self.probe_interval == 0
        total = 0.0
        for req in requests:
            a, term, tokens = req.spec_acceptance, 1.0, 1.0
            for _ in range(min(width - 1, self._row_drafts(req, probe))):
                term *= a
                tokens += term
            total += tokens
        return total / len(requests)

    def choose_cap(self, requests: list[DynamicInferenceRequest], step: int) -> int:
        """The adaptive rule (module doc): the most drafts a row of a step of ``requests`` at
        scheduler step ``step`` verifies (0: the step runs without drafts). Changes nothing."""
        B, costs = len(requests), self.costs
        if B == 0:
            return self.k
        plain = costs.cell(B, 1)
        if plain is None or step - plain.step > _PLAIN_MAX_AGE:
            return 0  # measure what a plain step costs at this batch first
        best_w, best, floor = 1, 1.0, 1.0
        for w in self.widths:
            g = self.gain(requests, w, step)
            r, cell = costs.ratio(B, w), costs.cell(B, w)
            lo, hi = costs.ratio_bounds(B, w)
            lo = max(lo, floor)  # a wider row costs at least a narrower one
            if r is not None:
                floor = max(floor, r)
                fresh = step - cell.step <= min(4096, max(64, int((r - 1) / _RETRY_LOSS)))
                if fresh or g <= lo:
                    if g / r > best:
                        best_w, best = w, g / r
                    continue
            if g <= lo:
                continue  # cannot pay even at the least this width may cost
            if hi != float("inf") and g / hi > best:
                best_w, best = w, g / hi  # pays even at the most it may cost
                continue
            return w - 1  # unmeasured (or due again) and it may pay: try it, measure it
        return best_w - 1

    def observe_step(self, rows: int, drafts: int, seconds: float) -> None:
        """A landed decode step of ``rows`` rows whose widest row verified ``drafts`` drafts took
        ``seconds`` (the wall time of the engine's ``step()`` that landed it)."""
        if not self.adaptive:
            return
        width = 1 if drafts == 0 else next((w for w in self.widths if w >= drafts + 1), drafts + 1)
        self.costs.observe(rows, width, seconds, self.step)

    def admit(self, req: DynamicInferenceRequest) -> None:
        """A new request (not a recompute after eviction) starts from the engine's recent acceptance."""
        req.spec_acceptance = self.recent_acceptance

    def observe(self, req: DynamicInferenceRequest, drafted: int, accepted: int) -> None:
        """Fold one bookkept verify row into the request's acceptance average, weighted as its
        ``drafted`` drafts one by one: a row of k rejected drafts is k pieces of evidence (at
        k = 3 and 0 % acceptance a request switches off after 2 verify rows instead of 5, each
        of which costs a (k + 1)-token row), a probe one; and into the engine's average.
        Adaptive mode averages the acceptance per position instead (the a of the gain 1 + a +
        a^2 + ...): a row tried ``accepted`` positions that were accepted and, when it stopped
        short, one rejected one (``_position_update``)."""
        if drafted <= 0:
            return
        if self.adaptive:
            tried = accepted + (accepted < drafted)
            req.spec_acceptance = _position_update(req.spec_acceptance, accepted, tried, drafted, _EMA)
            self.recent_acceptance = _position_update(self.recent_acceptance, accepted, tried, drafted,
                                                      _ENGINE_POSITION_EMA)
        else:
            rate = accepted / drafted
            req.spec_acceptance += (1.0 - (1.0 - _EMA) ** drafted) * (rate - req.spec_acceptance)
            self.recent_acceptance += (1.0 - (1.0 - _ENGINE_EMA) ** drafted) * (rate - self.recent_acceptance)


def _never_drafts(req: DynamicInferenceRequest) -> bool:
    """Penalties count every sample of a row on the device, rejected ones too; a grammar's masks
    come from the host, one per row."""
    sp = req.sampling_params
    return sp.has_penalties or sp.structured_outputs is not None
