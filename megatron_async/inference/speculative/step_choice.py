"""The adaptive rule (``speculative_adaptive``, the CUDA default): before a step's decode rows
draft, pick the kind of step that costs least per generated token at this batch, from what
was measured.

A step of B decode rows is either plain (1 token per row) or a verify step of width W (one
of the verify graphs' widths; every row drafts up to W - 1 and is padded to W). Per row it
brings G(W) = mean over rows of 1 + a + ... + a^(W-1) tokens (G(1) = 1; a: the row's
per-position acceptance) and costs R(B, W) = cost(B, W) / cost(B, 1) plain steps, so the
step runs the kind with the largest G / R: cost per generated token, compared directly.

Costs (step_cost.py) are the walls of landed decode steps per batch bucket and width, but only
of steady steps: a verify step after a verify step of the same width, a plain step (no
drafter) after a step without drafts. A step after a change of kind carries the other kind's
landing and launch in its wall, and a decode step that runs the drafter without drafts (the
step before drafting resumes, the one after it stops) is neither kind; both were once counted
as plain steps, which made plain look dearer than it is exactly where drafting nearly pays.
A bucket with nothing measured uses the nearest measured bucket within a factor of 2;
farther, bounds (R does not fall as the batch or the width grows) decide what may pay.

Exploring: once a batch has kept its bucket for ``_SETTLE`` decisions (a finishing batch
passes through buckets without trials), a kind whose R is unknown and may win is tried for
``_TRIAL`` steps (the first is the change, the rest are measured), narrow widths first. A
measured kind that loses is tried again (one step; plain four, its middle ones without the
drafter) once the steps since its last try cost ``_BUDGET`` of the time the try wastes, so
each losing kind costs at most ~0.4 % (width 4 at batch 128 / 50 %: every ~70 steps).

Acceptance: a request's estimate is its own accepted / tried positions (decayed by
``_DECAY`` per verify row; ``spec_positions`` holds them) plus ``_PRIOR`` positions of the
engine's estimate, the same over every request's rows (decayed by 1/64 per row). A new
request has only the engine's, so after a 0 % workload a new one would never draft: while plain
steps win and half the rows have no evidence of their own, a probe step verifies one draft
per row (not on two steps in a row: the first lands after the next is planned)."""
from __future__ import annotations

import math

from megatron_async.inference.speculative.step_cost import StepCosts, bucket

_TRIAL = 3
_BUDGET = 0.004
_DECAY = 0.85
_PRIOR = 4.0  # positions of the engine's acceptance in a request's estimate
_ENGINE_DECAY = 1 - 1 / 64
_MAX_WAIT, _MIN_WAIT = 4096, 16  # steps between two tries of one kind
_SETTLE = 8  # decisions at one batch bucket before it explores there


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

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 1.0

    def observe_row(self, req, drafted: int, accepted: int) -> None:
        tried = accepted + (accepted < drafted)
        t = req.spec_positions
        own = req.spec_acceptance * t * _DECAY + accepted
        req.spec_positions = t = t * _DECAY + tried
        req.spec_acceptance = own / t
        self.accepted = self.accepted * _ENGINE_DECAY + accepted
        self.tried = self.tried * _ENGINE_DECAY + tried

    def observe_step(self, rows: int, width: int, seconds: float, drafter: bool, step: int) -> None:
        prev, self._prev_width = self._prev_width, width
        if prev == width and not (width == 1 and drafter):
            self.costs.observe(rows, width, seconds, step)

    def gains(self, requests, drafts_ok) -> tuple[dict[int, float], int]:
        """({W: G(W)}, rows without evidence of their own)."""
        K = self.widths[-1] - 1
        sums, prior, new = [0.0] * (K + 1), self.acceptance, 0
        for req in requests:
            if not drafts_ok(req):
                continue
            t = req.spec_positions
            new += t < 1.5
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
        near = sorted((abs(math.log(o / b)), o) for (o, w) in self.costs.cells
                      if w == width and b // 2 <= o <= 2 * b)
        for _, o in near:
            r = self.costs.ratio(o, width)
            if r is not None:
                return r, self.costs.cells[(o, width)].step
        return None, None

    def choose(self, requests, step: int, drafts_ok) -> int:
        """The most drafts a row of a step of ``requests`` at scheduler step ``step`` verifies
        (0: no drafts). Deciding a step twice gives the same answer (``may_any_draft_next``
        asks a step ahead, ``plan_step`` then reuses it)."""
        B = len(requests)
        if (step, B) == self._cache[:2]:
            return self._cache[2]
        cap = self._choose(requests, step, B, drafts_ok)
        self._cache = (step, B, cap)
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
            est[w] = self.ratio(B, w)
            lo, hi = self.costs.ratio_bounds(B, w)
            bounds[w] = max(lo, floor), hi  # a wider row costs at least a narrower one
            floor = max(floor, est[w][0] or lo)
        # the best kind at its worst cost (an unknown R at the most larger batches allow)
        worst = {w: est[w][0] or bounds.get(w, (0, 0))[1] for w in est}
        best = max(worst, key=lambda w: G[w] / worst[w])
        v_best = G[best] / worst[best]
        if best == 1 and new * 2 >= B and self.last_drafts < step - 1:
            return 1  # probe: what a new workload's drafts bring (one draft per row)
        if self._steady < _SETTLE:  # a batch size passing by (a batch finishing): no trials
            return best - 1
        for w in self.widths:  # an unknown R that may win: try it (narrow first: a cheaper trial)
            if est[w][0] is None and G[w] / bounds[w][0] > v_best:
                return self._try(b, 1 if plain is None else w, step, _TRIAL)
        for w, (r, at) in est.items():  # a measured loser, due again
            if w != best and at is not None:
                at = max(at, self._tried.get((b, w), at))
                if w == 1:  # a plain trial: its middle steps run without the drafter
                    length, waste = _TRIAL + 1, (_TRIAL + 1) * (1 - 1 / v_best)
                else:  # one step: its cost is known, what its drafts bring now is not
                    length, waste = 1, r - G[w] / v_best
                if step - at > min(_MAX_WAIT, max(_MIN_WAIT, waste / (_BUDGET * worst[best]))):
                    return self._try(b, w, step, length)
        return best - 1

    def _try(self, b: int, width: int, step: int, length: int) -> int:
        self.trial = (b, width, step + length - 1)
        self._tried[(b, width)] = step
        return width - 1
