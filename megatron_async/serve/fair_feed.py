"""Fair admission between HTTP bodies: which submission's choices the engine loop hands to the
engine next. The engine admits FIFO; the server decides the order in which requests reach it.

The policy (README "Serving: fairness"):
- The server keeps at most ``max_requests`` choices in the engine at once (running or queued
  there); the rest wait here, so the engine's own queue stays short and a request that arrives
  later is never behind thousands of others in it.
- Bodies of a lower ``priority`` class (``SamplingParams.priority``, the same for a body's
  choices) go before those of higher ones; within a class, a body (submission) with nothing in
  the engine goes first, the others take turns, one choice each (round-robin), in the order they
  last had a turn. (The engine ages the requests that wait in its own queue; here a low class
  waits while lower ones keep coming, as with vLLM's priority scheduling.)
- One body never holds more than ``body_cap`` places (``max_requests`` less a reserve, see
  ``body_cap``): a lone huge body leaves places free, so a short request sent behind it starts
  at once instead of after one of the huge body's requests ends.

Each operation costs O(1) per choice however many bodies or choices wait (times the number of
priority classes waiting, usually one): the bodies waiting for a turn are kept in
insertion-ordered dicts keyed by identity, two per class."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    places: int = 0
    """Its choices in the engine (handed over, not yet ended)."""

    @property
    def pending(self) -> int:
        return len(self.sub.choices) - self.next


class FairFeed:
    def __init__(self, max_requests: int, cap: int | None = None):
        """``cap``: the most places of one body (default ``body_cap(max_requests)``)."""
        self.max_requests = max_requests
        self.cap = body_cap(max_requests) if cap is None else cap
        self._bodies: dict[int, _Body] = {}
        """id(submission) -> its state, for every body with a choice pending or in the engine."""
        self._classes: dict[int, tuple[dict[int, _Body], dict[int, _Body]]] = {}
        """Priority -> (bodies with choices pending and none in the engine: served first, oldest
        first; bodies with choices pending and some in the engine, below the cap: round-robin)."""
        self.placed = 0
        """Choices in the engine, over all bodies."""
        self.pending = 0
        """Choices waiting here, over all bodies."""

    def add(self, sub, priority: int = 0) -> None:
        """A submission whose choices all wait for the engine (``priority``: their class)."""
        body = self._bodies[id(sub)] = _Body(sub, priority)
        if body.pending:
            self._queues(body)[0][id(sub)] = body
            self.pending += body.pending

    def place(self, sub, count: int) -> None:
        """``count`` choices of ``sub`` went to the engine directly (``fits``), none pending."""
        body = self._bodies[id(sub)] = _Body(sub, next=count, places=count)
        self.placed += count
        assert body.pending == 0

    def fits(self, count: int) -> bool:
        """Whether a new body of ``count`` choices can go to the engine whole, right now."""
        return not self.pending and count <= self.cap and self.placed + count <= self.max_requests

    def take(self) -> list[tuple[Any, int]]:
        """The (submission, choice index) pairs to hand to the engine now, in order."""
        out = []
        while self.placed < self.max_requests and (body := self._next()) is not None:
            key = id(body.sub)
            out.append((body.sub, body.next))
            body.next += 1
            body.places += 1
            self.placed += 1
            self.pending -= 1
            if body.pending and body.places < self.cap:
                self._queues(body)[1][key] = body  # the back of the rotation
        return out

    def _queues(self, body: _Body) -> tuple[dict[int, _Body], dict[int, _Body]]:
        return self._classes.setdefault(body.priority, ({}, {}))

    def _next(self) -> _Body | None:
        """The body whose choice goes next, taken off its queue (None: none waits)."""
        for priority in sorted(self._classes):
            new, turns = self._classes[priority]
            if new or turns:
                pool = new or turns
                return pool.pop(next(iter(pool)))
            del self._classes[priority]
        return None

    def ended(self, sub) -> None:
        """One choice of ``sub`` that was in the engine ended."""
        key = id(sub)
        body = self._bodies.get(key)
        if body is None:
            return
        body.places -= 1
        self.placed -= 1
        if body.pending:
            new, turns = self._queues(body)
            if body.places == 0:
                turns.pop(key, None)
                new[key] = body
            elif key not in turns and key not in new:  # was at the cap
                turns[key] = body
        elif body.places == 0:
            del self._bodies[key]

    def drop(self, sub) -> range:
        """``sub`` goes away (aborted): the indices of its choices that never reached the engine."""
        key = id(sub)
        body = self._bodies.get(key)
        if body is None:
            return range(0)
        for queue in self._queues(body):
            queue.pop(key, None)
        left = range(body.next, len(sub.choices))
        self.pending -= len(left)
        body.next = len(sub.choices)
        if body.places == 0:
            del self._bodies[key]
        return left
