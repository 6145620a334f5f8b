"""The scheduler's queue of requests waiting for admission: new requests join at the back, evicted
ones go back to the front, admission takes the head. Every operation is O(1) (amortized) however
long the queue: a request leaves from anywhere (aborted, finished by its last in-flight sample)
by its id, never by a search of the queue or by comparing requests field by field.

A request that leaves in the middle stays in the deque as a stale entry (its ticket is no longer
its id's live one) until it reaches the head, or until stale entries outnumber live ones (plus
``COMPACT_SLACK``) or the queue empties: then the deque is rebuilt without them, so neither memory
nor a walk of the queue grows with the requests that left."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from megatron_async.inference.request import DynamicInferenceRequest

COMPACT_SLACK = 64


class WaitingQueue:
    def __init__(self):
        self._entries: deque[tuple[int, DynamicInferenceRequest]] = deque()
        self._live: dict[int, int] = {}
        """request id -> the ticket of its entry in the queue (one per request)."""
        self._next_ticket = 0
        self.version = 0
        """Bumped by every change but ``append``: while it holds, the queue only grew at the back
        (``appended_since``), so a sum over it can be carried on instead of redone."""

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, req: DynamicInferenceRequest) -> bool:
        return req.request_id in self._live

    def __iter__(self) -> Iterator[DynamicInferenceRequest]:
        """The waiting requests, head first."""
        live = self._live
        return (req for ticket, req in self._entries if live.get(req.request_id) == ticket)

    @property
    def mark(self) -> int:
        """The ticket the next request takes (``appended_since``)."""
        return self._next_ticket

    def appended_since(self, mark: int) -> list[DynamicInferenceRequest]:
        """The live requests appended since ``mark`` was read (``version`` unchanged since),
        oldest first: a walk from the back over those entries alone."""
        live, out = self._live, []
        for ticket, req in reversed(self._entries):
            if ticket < mark:
                break
            if live.get(req.request_id) == ticket:
                out.append(req)
        out.reverse()
        return out

    def append(self, req: DynamicInferenceRequest) -> None:
        self._entries.append((self._ticket(req), req))

    def appendleft(self, req: DynamicInferenceRequest) -> None:
        self.version += 1
        self._entries.appendleft((self._ticket(req), req))

    def head(self) -> DynamicInferenceRequest | None:
        """The next request to admit (None: the queue is empty)."""
        self._drop_stale_head()
        return self._entries[0][1] if self._entries else None

    def popleft(self) -> DynamicInferenceRequest:
        self.version += 1
        self._drop_stale_head()
        _, req = self._entries.popleft()
        del self._live[req.request_id]
        return req

    def discard(self, req: DynamicInferenceRequest) -> bool:
        """Take ``req`` out wherever it is; False if it was not waiting."""
        if self._live.pop(req.request_id, None) is None:
            return False
        self.version += 1
        if not self._live:
            self._entries.clear()
        elif len(self._entries) > 2 * len(self._live) + COMPACT_SLACK:
            live = self._live
            self._entries = deque(e for e in self._entries if live.get(e[1].request_id) == e[0])
        return True

    def _ticket(self, req: DynamicInferenceRequest) -> int:
        if req.request_id in self._live:
            raise ValueError(f"request {req.request_id} is already waiting")
        ticket = self._live[req.request_id] = self._next_ticket
        self._next_ticket += 1
        return ticket

    def _drop_stale_head(self) -> None:
        entries, live = self._entries, self._live
        while entries and live.get(entries[0][1].request_id) != entries[0][0]:
            entries.popleft()
