"""What an HTTP request hands the engine loop and gets back: its choices (``Choice``), the
submission that carries them with the asyncio side the engine thread reports to
(``Submission``, ``LoopSink``), and each step's ``ChoiceEvent`` per choice."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from megatron_async.inference.request import RequestOutput, RequestUpdate, SamplingParams


class GenerationBlockedError(RuntimeError):
    """A request refused because the engine cannot generate now (its memory is suspended, or its
    weights incomplete, and generation is not paused, so it would not wait either): HTTP 503."""


@dataclass(frozen=True)
class Choice:
    """One engine request of an HTTP request (a prompt, or one of its ``n`` samples)."""

    prompt_tokens: list[int]
    params: SamplingParams


class ChoiceEvent(NamedTuple):
    """What a step gave one choice: an update (new tokens / text), its final output, or an error.
    A NamedTuple: one is built per request per step."""

    index: int
    update: RequestUpdate | None = None
    """A ``StepResult.updates`` entry."""
    output: RequestOutput | None = None
    """Set once, when the engine request ended (finished, stopped, aborted)."""
    error: str | None = None
    """The engine failed this request (a step raised); the choice ends here."""

    @property
    def is_last(self) -> bool:
        return self.output is not None or self.error is not None


class LoopSink:
    """Where the engine thread sends the results of submissions made on ``loop`` (an event loop
    of this process). A step's entries for one loop go in one call: ``EngineLoop._flush``
    groups them by ``batch_key``, the loop (a plain attribute: the grouping hashes each entry
    of each step)."""

    __slots__ = ("loop", "batch_key")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = self.batch_key = loop

    def deliver(self, batch: list[tuple[Submission, str, Any]]) -> None:
        """On the engine thread: ``batch`` = (submission, kind, payload) entries, in order."""
        try:
            self.loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop closed (shutdown): nobody is waiting any more
            pass


@dataclass
class Submission:
    """One HTTP request's choices, and the asyncio side the engine thread reports to."""

    choices: list[Choice]
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    request_ids: list[int] = field(default_factory=list)
    """Engine ids of the choices, in order (filled by the engine thread at admission)."""

    def __post_init__(self):
        self.admitted: asyncio.Future = self.loop.create_future()
        """Resolves to the request ids; raises InvalidRequestError (a bad request) or
        RuntimeError (the engine failed) when admission did not happen."""
        self.events: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self.sink = LoopSink(self.loop)


def unsent_abort(sub: Submission, index: int) -> ChoiceEvent:
    """The end of choice ``index`` of ``sub``, aborted before it reached an engine (no request id)."""
    return ChoiceEvent(index, output=RequestOutput(-1, sub.choices[index].prompt_tokens, [], "", "abort"))


def _deliver(batch: list[tuple[Submission, str, Any]]) -> None:
    """On the event loop: hand a step's results to the waiting handlers."""
    for sub, kind, payload in batch:
        if kind == "event":
            sub.events.put_nowait(payload)
        elif not sub.admitted.done():
            (sub.admitted.set_result if kind == "admitted" else sub.admitted.set_exception)(payload)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)
