"""Fair admission between HTTP bodies: which submission's choices go to the engine next, and,
with ``share``, which of those in the engine wait while other bodies run. The engine admits in
its own order; the server decides in which order requests reach it.

The policy (README "Serving: fairness"):
- At most ``max_requests`` choices are in the engine at once (running or queued there); the rest
  wait here, so the engine's own queue stays short and a request that arrives later is never
  behind thousands of others in it.
- Classes: a body's class is its ``priority`` (``SamplingParams.priority``, the same for a body's
  choices) lowered by one for every ``aging`` choices handed to the engine since its last turn
  (or its arrival): the engine's rule and setting (``admission_order.aged_class``,
  ``InferenceConfig.priority_aging``), so a class that lower ones keep passing still progresses.
  A class waits as long as the body it would serve next; the lowest class goes first, on a tie
  the one waiting longest.
- Within a class, a body with nothing in the engine goes first, the others take turns, one
  choice each (round-robin), in the order they last had a turn.
- One body never holds more than ``body_cap`` places (``max_requests`` less a reserve): a lone
  huge body leaves places free, so a short request sent behind it starts at once.
- ``share`` (a CPU engine, whose step time grows with its rows): while k bodies have choices in
  the engine, each one runs at most ``max_requests // k`` of them (at least one). It takes no
  new place above that, and its newest places above it are held (``held``: the engine keeps
  their KV and runs no row for them) until others leave. A short request behind a huge body
  then runs in steps of about half the rows; a body alone keeps every place.

Each operation costs O(1) per choice however many bodies or choices wait (times the number of
priority classes waiting, usually one); a body leaving the engine looks at the bodies parked at
their share (at most one per place)."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from megatron_async.config import InferenceConfig
from megatron_async.inference.engines.admission_order import aged_class

BODY_RESERVE_SHARE = 16
"""The reserve one body cannot fill: ``max_requests // BODY_RESERVE_SHARE`` places, at least one."""


def body_cap(max_requests: int) -> int:
    """The most places one body may hold: ``max_requests`` less the reserve (at least 1)."""
    return max(1, max_requests - max(1, max_requests // BODY_RESERVE_SHARE))


@dataclass(eq=False)
class _Body:
    sub: Any
    priority: int = 0
    next: int = 0
    """Index of its next choice not yet handed to the engine."""
    places: dict[int, None] = field(default_factory=dict)
    """Indices of its choices in the engine (handed over, not yet ended), oldest first."""
    turn_at: int = 0
    """``FairFeed.handed`` at its arrival or its last turn: its wait is counted from there."""

    @property
    def pending(self) -> int:
        return len(self.sub.choices) - self.next


class FairFeed:
    def __init__(self, max_requests: int, aging: int = InferenceConfig.priority_aging, share: bool = False,
                 cap: int | None = None):
        """``aging``: the engine's ``priority_aging``; ``share``: bodies in the engine share its
        places (held beyond their share); ``cap``: the most places of one body (default
        ``body_cap(max_requests)``)."""
        self.max_requests, self.aging, self.share = max_requests, aging, share
        self.cap = body_cap(max_requests) if cap is None else cap
        self._bodies: dict[int, _Body] = {}
        """id(submission) -> its state, for every body with a choice pending or in the engine."""
        self._classes: dict[int, tuple[dict[int, _Body], dict[int, _Body]]] = {}
        """Priority -> (bodies with choices pending and none in the engine: served first, oldest
        first; bodies with choices pending and some in the engine, below their limit: round-robin)."""
        self._in_engine: dict[int, _Body] = {}
        """Bodies with choices in the engine."""
        self._parked: dict[int, _Body] = {}
        """Bodies with choices pending and as many in the engine as ``limit`` allows."""
        self.placed = 0
        """Choices in the engine, over all bodies."""
        self.pending = 0
        """Choices waiting here, over all bodies."""
        self.handed = 0
        """Choices handed to the engine so far (the admissions that age waiting bodies)."""

    def resize(self, max_requests: int) -> None:
        """The engine's places changed (engines behind a coordinator come and go): the limits
        follow (the cap back to ``body_cap``)."""
        self.max_requests, self.cap = max_requests, body_cap(max_requests)
        for body in list(self._parked.values()):
            self._requeue(body)

    def limit(self, bodies: int | None = None) -> int:
        """The most places one body holds for running while ``bodies`` (default: as many as now)
        have choices in the engine."""
        k = len(self._in_engine) if bodies is None else bodies
        return min(self.cap, max(1, self.max_requests // k)) if self.share and k > 1 else self.cap

    def add(self, sub, priority: int = 0) -> None:
        """A submission whose choices all wait for the engine (``priority``: their class)."""
        body = self._bodies[id(sub)] = _Body(sub, priority, turn_at=self.handed)
        if body.pending:
            self._queues(body)[0][id(sub)] = body
            self.pending += body.pending

    def place(self, sub, count: int) -> None:
        """``count`` choices of ``sub`` went to the engine directly (``fits``), none pending."""
        body = self._bodies[id(sub)] = _Body(sub, next=count, places=dict.fromkeys(range(count)))
        assert body.pending == 0
        self.placed += count
        self.handed += count
        if count:
            self._in_engine[id(sub)] = body

    def fits(self, count: int) -> bool:
        """Whether a new body of ``count`` choices can go to the engine whole, right now."""
        return (not self.pending and count <= self.limit(len(self._in_engine) + 1)
                and self.placed + count <= self.max_requests)

    def take(self) -> list[tuple[Any, int]]:
        """The (submission, choice index) pairs to hand to the engine now, in order."""
        out = []
        while self.placed < self.max_requests and (body := self._next()) is not None:
            if len(body.places) >= self.limit():  # the share shrank since it queued
                self._parked[id(body.sub)] = body
                continue
            out.append((body.sub, body.next))
            body.places[body.next] = None
            body.next += 1
            self._in_engine[id(body.sub)] = body
            self.placed += 1
            self.pending -= 1
            self.handed += 1
            body.turn_at = self.handed
            if body.pending:
                self._requeue(body)  # the back of the rotation
        return out

    def held(self) -> list[tuple[Any, int]]:
        """(submission, choice index) of the places above their body's share, newest of each
        body: the engine keeps them and runs no row for them. Empty without ``share``."""
        limit = self.limit()
        if limit >= self.cap:
            return []
        return [(b.sub, i) for b in self._in_engine.values() if len(b.places) > limit
                for i in islice(b.places, limit, None)]

    def ended(self, sub, index: int) -> None:
        """Choice ``index`` of ``sub``, which was in the engine, ended."""
        key = id(sub)
        body = self._bodies.get(key)
        if body is None or index not in body.places:
            return
        del body.places[index]
        self.placed -= 1
        if not body.places:
            del self._in_engine[key]
            for other in list(self._parked.values()):  # the others' share grew
                self._requeue(other)
        if body.pending:
            self._requeue(body)
        elif not body.places:
            del self._bodies[key]

    def drop(self, sub) -> range:
        """``sub`` goes away (aborted): the indices of its choices that never reached the engine."""
        key = id(sub)
        body = self._bodies.get(key)
        if body is None:
            return range(0)
        self._unqueue(body)
        left = range(body.next, len(sub.choices))
        self.pending -= len(left)
        body.next = len(sub.choices)
        if not body.places:
            del self._bodies[key]
        return left

    def _queues(self, body: _Body) -> tuple[dict[int, _Body], dict[int, _Body]]:
        return self._classes.setdefault(body.priority, ({}, {}))

    def _unqueue(self, body: _Body) -> None:
        key = id(body.sub)
        self._parked.pop(key, None)
        for queue in self._classes.get(body.priority, ()):
            queue.pop(key, None)

    def _requeue(self, body: _Body) -> None:
        """A body with choices pending goes where it belongs now: with nothing in the engine to
        the newcomers, below its limit to the rotation (kept in place if already there), else
        parked."""
        key = id(body.sub)
        new, turns = self._queues(body)
        if body.places and len(body.places) >= self.limit():
            turns.pop(key, None)
            self._parked[key] = body
        elif key not in (turns if body.places else new):
            self._unqueue(body)
            (turns if body.places else new)[key] = body

    def _next(self) -> _Body | None:
        """The body whose choice goes next, taken off its queue (None: none waits): the head of
        the class that is lowest once aged, the longest waiting on a tie."""
        best, best_rank = None, None
        for priority, (new, turns) in list(self._classes.items()):
            pool = new or turns
            if not pool:
                del self._classes[priority]
                continue
            head = next(iter(pool.values()))
            rank = (aged_class(priority, self.handed - head.turn_at, self.aging), head.turn_at, priority)
            if best_rank is None or rank < best_rank:
                best, best_rank = pool, rank
        return None if best is None else best.pop(next(iter(best)))
