"""The adaptive rule (``speculative_adaptive``, the CUDA default): before a step's decode rows
draft, pick the kind of step that costs least per generated token at this batch, from what
was measured.

A step of B decode rows is either plain (1 token per row) or a verify step of width W (one
of the verify graphs' widths; every row drafts up to W - 1 and is padded to W). Per row it
brings G(W) = mean over rows of 1 + a + ... + a^(W-1) tokens (G(1) = 1; a: the row's
per-position acceptance) and costs R(B, W) = cost(B, W) / cost(B, 1) plain steps. The step runs
the kind with the largest G / R, a verify kind's divided by 1 + ``_MARGIN`` * min(1, B / 128): at
batch 128 drafting must win by 20 % per token. What a step's count misses there: a closed
batch's requests finish apart once drafts land unevenly (a tail of small steps), and where the
host bounds the step a verify step's landing grows with the tokens it brings (bench_speculative
on the H100, batch 128: forced drafting at 80 % is 0.86x plain although a verify step costs
~2.9 plain ones for 2.95 tokens per row). A measured R is never below a narrower kind's (or
plain's: 1): a verify step does a plain step's work and more, and a noisy cell priced below it
drafted at batch 1 / 0 %.

Costs (step_cost.py) are the walls of landed decode steps per batch bucket and width, but only
of steady steps: a verify step after a verify step of the same width, a plain step (no
drafter) after a step without drafts. A step after a change of kind carries the other kind's
landing and launch in its wall, and a decode step that runs the drafter without drafts (the
step before drafting resumes, the one after it stops) is neither kind. A verify sample over
1.5 W plain steps is a hiccup and counts as that; a cell of one sample (a trial's) bounds no
wider kind. A bucket with nothing measured uses the nearest measured bucket within a factor of
2; farther, bounds (R does not fall as the batch or the width grows) decide what may pay.

Exploring: once a batch has kept its bucket for ``_SETTLE`` decisions (a finishing batch
passes through buckets without trials), a kind whose R is unknown and may win is tried for
``_TRIAL`` steps (the first is the change, the second is measured), the widest such kind first
(its R then bounds the narrower ones from below: R(w) >= 1 + (R(W) - 1)(w - 1)/(W - 1)). "May
win" is judged at the least it may cost, which at a large batch is the row prior
(``StepCosts.row_prior``: each draft token costs what a row adds to a plain step), so batch 128
at 50 % tries nothing. A width is not tried again before its trial's measured step has landed
(launch-ahead: that is after the next step is planned; trying again doubled every trial). A
measured kind that loses is tried again (one step; plain three, its middle ones without the
drafter) once the steps since its last try cost ``_BUDGET`` of the time the try wastes, a
change of kind counted as ``_SWITCH`` plain steps more.

Acceptance: a request's estimate is its own accepted / tried positions (decayed by
``_DECAY`` per verify row; ``spec_positions`` holds them) plus ``_PRIOR`` positions of the
engine's estimate, the same over every request's rows (decayed by 1/64 per row). A new
request has only the engine's, so after a 0 % workload a new one would never draft: while plain
steps win and half the rows have no evidence of their own, a probe step verifies one draft per
row (not on two steps in a row: the first lands after the next is planned); a probe of
``_PROBE_ROWS`` rows or more is evidence enough, smaller batches probe twice. While plain wins,
a probe also comes when the steps since the last drafts cost ``_PROBE_BUDGET`` of the time a
probe wastes (a row's few positions may have been unlucky). No step that carries prefill chunks
drafts (``SpecPolicy.plan_step``): a probe there ran a 2,048-token step eager.

Host cost: the gains pass over the rows is kept while the rows and the verify rows observed are
the same (a plain step's choice is then one pass in C over the rows' ids)."""
from __future__ import annotations

import math

from megatron_async.inference.speculative.step_cost import StepCosts, bucket

_TRIAL = 2
_BUDGET = 0.004
_SWITCH = 0.6  # plain steps a change of kind costs besides its steps (the drafter's runs around it)
_MARGIN = 0.2  # a verify kind must beat plain by this much per token at large batches (a closed batch's
_MARGIN_ROWS = 128  # tail, the host's landing): in proportion up to this many rows
_DECAY = 0.85
_PRIOR = 4.0  # positions of the engine's acceptance in a request's estimate
_ENGINE_DECAY = 1 - 1 / 64
_MAX_WAIT, _MIN_WAIT = 4096, 16  # steps between two tries of one kind
_SETTLE = 8  # decisions at one batch bucket before it explores there
_PROBE_BUDGET = 0.005  # share of the time probes of a plain batch may waste
_PROBE_ROWS = 16  # a probe step of this many rows tells enough: its rows probe once (fewer: twice)


class StepChoice:
    def __init__(self, widths: list[int]):
        self.widths = widths
        self.costs = StepCosts()
        self.accepted = self.tried = 0.0
        """Engine's decayed sums of accepted and tried positions over every verify row."""
        self.trial: tuple[int, int, int] | None = None
        """(bucket, width, last step) of the kind being tried."""
        self.last_drafts = -(1 << 30)
        """Latest step planned with drafts (the probe clock)."""
        self._prev_width = 0
        self._bucket = self._steady = 0
        self._tried: dict[tuple[int, int], int] = {}
        self._cache = (-1, -1, 0)
        self._start: tuple | None = None  # (trial, (key, step) of ``_tried``) a decision of ``_cache`` begins
        self._rows_seen = 0  # verify rows observed: the gains change only with them (and the rows)
        self.admitted = 0
        """Requests admitted (``SpecPolicy.admit``): with the rows' ids, names the set of rows."""
        self._gains: tuple = (None, None)  # (key, gains()) of the latest step

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 1.0

    def observe_row(self, req, drafted: int, accepted: int) -> None:
        tried = accepted + (accepted < drafted)
        t = req.spec_positions
        own = req.spec_acceptance * t * _DECAY + accepted
        req.spec_positions = t = t * _DECAY + tried
        req.spec_acceptance = own / t
        self._rows_seen += 1
        self.accepted = self.accepted * _ENGINE_DECAY + accepted
        self.tried = self.tried * _ENGINE_DECAY + tried

    def observe_step(self, rows: int, width: int, seconds: float, drafter: bool, step: int) -> None:
        prev, self._prev_width = self._prev_width, width
        if prev == width and not (width == 1 and drafter):
            plain = self.costs.cell(rows, 1)
            if width > 1 and plain is not None:  # a W-token row costs less than 1.5 W plain rows:
                seconds = min(seconds, 1.5 * width * plain.seconds)  # more is a hiccup (a trial's one sample)
            self.costs.observe(rows, width, seconds, step)

    def gains(self, requests, drafts_ok) -> tuple[dict[int, float], int]:
        """({W: G(W)}, rows without evidence of their own). The same rows with no verify row
        observed since give the same answer: a plain step costs one pass in C, not one in Python.
        The rows are keyed by their ids in order (a sum of ids can be equal for other rows)."""
        key = (self._rows_seen, self.admitted, tuple(map(id, requests)))
        if self._gains[0] == key:
            return self._gains[1]
        out = self._gains_of(requests, drafts_ok)
        self._gains = (key, out)
        return out

    def _gains_of(self, requests, drafts_ok) -> tuple[dict[int, float], int]:
        K = self.widths[-1] - 1
        sums, prior, new = [0.0] * (K + 1), self.acceptance, 0
        seen = 0.5 if len(requests) >= _PROBE_ROWS else 1.5  # positions that make a row's own evidence
        for req in requests:
            if not drafts_ok(req):
                continue
            t = req.spec_positions
            new += t < seen
            a = (_PRIOR * prior + req.spec_acceptance * t) / (_PRIOR + t)
            p = 1.0
            for i in range(1, K + 1):
                p *= a
                sums[i] += p
        B, g, out = len(requests), 1.0, {1: 1.0}
        for i in range(1, K + 1):
            g += sums[i] / B
            if i + 1 in self.widths:
                out[i + 1] = g
        return out, new

    def ratio(self, rows: int, width: int) -> tuple[float | None, int | None]:
        """(R(B, W), scheduler step W was measured at): this bucket's, else the nearest
        measured bucket's within a factor of 2."""
        b = bucket(rows)
        r = self.costs.ratio(b, width)
        if r is not None:  # (every step asks: this bucket's first, without a pass over the cells)
            return r, self.costs.cells[(b, width)].step
        near = sorted((abs(math.log(o / b)), o) for (o, w) in self.costs.cells
                      if w == width and b // 2 <= o <= 2 * b)
        for _, o in near:
            r = self.costs.ratio(o, width)
            if r is not None:
                return r, self.costs.cells[(o, width)].step
        return None, None

    def choose(self, requests, step: int, drafts_ok, commit: bool = True) -> int:
        """The most drafts a row of a step of ``requests`` at scheduler step ``step`` verifies
        (0: no drafts). Deciding a step twice gives the same answer (``may_any_draft_next``
        asks a step ahead, ``plan_step`` then reuses it). ``commit`` False: a look ahead; what
        the decision starts (the probe clock, a try's clock and its trial) starts only when a
        step is planned with it, so a step that then carries prefill chunks (no drafts) uses
        up neither a probe nor a try."""
        B = len(requests)
        if (step, B) != self._cache[:2]:
            self._start = None
            self._cache = (step, B, self._choose(requests, step, B, drafts_ok))
        cap = self._cache[2]
        if commit:
            if self._start is not None:  # a try begins (``_try``)
                self.trial, (key, at) = self._start
                self._tried[key] = at
                self._start = None
            if cap:
                self.last_drafts = step
        return cap

    def _choose(self, requests, step: int, B: int, drafts_ok) -> int:
        b = bucket(B)
        if self.trial is not None:
            tb, tw, last = self.trial
            if tb == b and step <= last:
                return tw - 1
            self.trial = None
        self._steady = self._steady + 1 if b == self._bucket else 0
        self._bucket = b
        G, new = self.gains(requests, drafts_ok)
        plain = self.costs.cell(B, 1)
        est, bounds, floor = {1: (1.0, plain.step if plain is not None else None)}, {}, 1.0
        for w in self.widths:
            r, at = self.ratio(B, w)
            est[w] = (None if r is None else max(r, floor), at)  # never below a narrower kind (or plain)
            cell = self.costs.cell(B, w)  # (a cell of one sample - a trial's - bounds no other)
            if r is not None and cell is not None and cell.samples > 1:
                floor = max(floor, est[w][0])  # (its bounds are read only while it is unmeasured)
                continue
            lo, hi = self.costs.ratio_bounds(B, w)
            bounds[w] = max(lo, floor), hi  # a wider row costs at least a narrower one
            floor = max(floor, lo)
        # the best kind at its worst cost (an unknown R at the most larger batches allow), a
        # verify kind's value less the margin it must win by
        worst = {w: est[w][0] or bounds.get(w, (0, 0))[1] for w in est}
        raw = {w: G[w] / worst[w] for w in est}
        margin = 1.0 + _MARGIN * min(1.0, B / _MARGIN_ROWS)
        best = max(raw, key=lambda w: raw[w] / (1.0 if w == 1 else margin))
        v_best = raw[best]
        if best == 1 and self.last_drafts < step - 1:  # probe: what drafts bring (one draft per row)
            if new * 2 >= B:  # a new workload
                return 1
            narrow = self.widths[0]  # else now and then: a row's few positions may have been unlucky
            r = est[narrow][0] or self.costs.row_prior(B, narrow)
            if step - self.last_drafts > (r - 1 + _SWITCH) / _PROBE_BUDGET:
                return 1
        if self._steady < _SETTLE:  # a batch size passing by (a batch finishing): no trials
            return best - 1
        hope = {}  # an unknown R that may win: the most it may bring, at the least it may cost
        for w in self.widths:
            if est[w][0] is None and step - self._tried.get((b, w), -_TRIAL) > _TRIAL:  # (a trial lands late)
                lo = max(bounds[w][0], self.costs.row_prior(B, w), *(
                    1 + (r - 1) * (w - 1) / (v - 1) for v, (r, _) in est.items() if v > w and r is not None))
                hope[w] = G[w] / lo
        hopeful = [w for w, h in hope.items() if h > v_best * margin ** (best == 1)]
        if hopeful:  # try the widest: once measured, it bounds the narrower ones from below
            return self._try(b, 1 if plain is None else hopeful[-1], step, _TRIAL)
        for w, (r, at) in est.items():  # a measured loser, due again
            if w != best and at is not None:
                at = max(at, self._tried.get((b, w), at))
                if w == 1:  # a plain trial: its middle steps run without the drafter
                    length, waste = _TRIAL + 1, (_TRIAL + 1) * (1 - 1 / v_best)
                else:  # one step: its cost is known, what its drafts bring now is not
                    length, waste = 1, max(r - G[w] / v_best, 0.0)
                waste += _SWITCH  # the drafter steps around a change of kind
                if step - at > min(_MAX_WAIT, max(_MIN_WAIT, waste / (_BUDGET * worst[best]))):
                    return self._try(b, w, step, length)
        return best - 1

    def _try(self, b: int, width: int, step: int, length: int) -> int:
        """Try ``width`` for ``length`` steps from ``step`` (started by ``choose``'s commit)."""
        self._start = ((b, width, step + length - 1), ((b, width), step))
        return width - 1
