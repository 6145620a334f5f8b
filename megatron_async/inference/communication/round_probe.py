"""Debug probe: where a consensus round's host time goes, phase by phase.

Off by default (``ZMQCommunicator.probe`` / ``StepConsensus.probe`` None: one ``is None`` test
per phase boundary). ``python -m benchmarks consensus --breakdown`` turns it on. A round is one
``StepConsensus.exchange`` (or one ``take_uploads``, kept apart as its own kind): ``start``, then
``mark(phase)`` at the end of each phase (the time since the previous mark goes to that phase),
then ``end``."""
from __future__ import annotations

import time
from collections import defaultdict

PHASES = ("build", "serialise", "publish", "post", "wait", "read", "deserialise", "apply")
"""In round order: the caller's ints and payload; pickling rank 0's payload; the slot write up
to the published seq; serialising this rank's upload after publishing; waiting for the other
ranks; reading the slots (max, checks); unpickling rank 0's payload; building the agreement."""


class RoundProbe:
    def __init__(self):
        self.rounds: dict[str, list[dict[str, int]]] = defaultdict(list)
        """By kind ("exchange", "take_uploads"): one {phase: ns} per round."""
        self._t = 0
        self._cur: dict[str, int] | None = None

    def start(self) -> None:
        self._cur = {}
        self._t = time.perf_counter_ns()

    def mark(self, phase: str) -> None:
        if self._cur is None:
            return
        t = time.perf_counter_ns()
        self._cur[phase] = self._cur.get(phase, 0) + t - self._t
        self._t = t

    def end(self, kind: str = "exchange") -> None:
        if self._cur is not None:
            self.rounds[kind].append(self._cur)
        self._cur = None

    def clear(self) -> None:
        self.rounds.clear()

    def p50_us(self, kind: str = "exchange", skip: float = 0.1) -> dict[str, float]:
        """Median us of every phase over the rounds of ``kind`` (a round without a phase counts
        0 for it), and of the rounds' totals ("total") and totals less waiting ("work"); the
        first ``skip`` share of the rounds is dropped (warm-up)."""
        rounds = self.rounds.get(kind, [])
        rounds = rounds[int(skip * len(rounds)):]
        if not rounds:
            return {}
        names = [p for p in PHASES if any(p in r for r in rounds)]
        names += sorted({p for r in rounds for p in r} - set(names))
        out = {p: _median([r.get(p, 0) for r in rounds]) for p in names}
        out["total"] = _median([sum(r.values()) for r in rounds])
        out["work"] = _median([sum(r.values()) - r.get("wait", 0) for r in rounds])
        out["rounds"] = len(rounds)
        return out


def _median(ns: list[int]) -> float:
    xs = sorted(ns)
    return xs[len(xs) // 2] / 1e3
