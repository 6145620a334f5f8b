"""The engine on its own thread, fed by HTTP handlers on the asyncio event loop.

The engine thread never waits for HTTP: handlers put commands (add / abort) into a thread-safe
inbox, and the thread takes them all at each step boundary, so requests join a running batch
between two ``engine.step()`` calls and launch-ahead keeps going. What a step produced
(``StepResult.updates`` and ``.finished``) goes back to each submission's sink in one call per
step and sink: a ``LoopSink`` (submission.py) hands it to an event loop of this process (one
``call_soon_threadsafe``, into one asyncio queue per HTTP request); a front-end process's sink
(bridge.py) sends it over its socket."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from megatron_async.inference.request import InvalidRequestError
from megatron_async.dp_engine.engine_ops import EVERY_RANK_OPS, Deferred, run_admin_op
from megatron_async.serve.fair_feed import FairFeed
from megatron_async.serve.metrics import ServerMetrics
from megatron_async.serve.submission import ChoiceEvent, GenerationBlockedError, Submission, _set_result, unsent_abort

log = logging.getLogger("megatron_async.serve")


@dataclass
class _Live:
    submission: Submission
    index: int
    failed: bool = False
    """Told it failed (a step raised); kept until the engine reports its abort, so that the
    loop keeps stepping until its blocks are freed, but nothing more is delivered."""
    num_tokens: int = 0
    last_token_at: float | None = None


MAX_FAILED_STEPS = 3
"""Consecutive failed steps after which the loop stops stepping for the requests it failed."""
TP_HEARTBEAT_S = 30.0
"""Under TP an idle rank 0 tells the other ranks so this often (their receives time out after 300 s)."""


class EngineLoop:
    def __init__(self, engine, metrics: ServerMetrics, communicator=None, update_weights: Callable | None = None,
                 share: bool | None = None):
        """``communicator``: tensor parallelism; this loop runs on rank 0 and tells the other
        ranks (``follow_rank0``) at each iteration whether to step, wait or stop, and which
        requests are held. ``update_weights``: the LLM's, for the admin operation of that name
        (dp_engine/engine_ops.py). ``share``: bodies share the engine's places (fair_feed.py; None: on a CPU
        engine, where a step's time grows with its rows)."""
        self.engine = engine
        if share is None:
            share = not engine.context.device.is_cuda
        self.feed = FairFeed(engine.config.max_requests, engine.config.priority_aging, share)
        """The order in which submissions' choices reach the engine (fair_feed.py)."""
        self._held_ids: frozenset[int] = frozenset()
        """The request ids the engine holds (the places above their body's share)."""
        self.metrics = metrics
        self._comm = communicator
        self._update_weights = update_weights
        self._inbox: queue.SimpleQueue[tuple[str, Submission | None]] = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._outbox: list[tuple[Submission, str, Any]] = []
        self._failed_steps = 0
        self._paused_idle = False
        """Generation is paused and the last step did nothing: wait for commands, do not spin."""
        self._thread = threading.Thread(target=self._run, name="megatron-async-engine", daemon=True)
        self.steps = 0
        # read when /metrics is scraped, so that they are current even while a long step runs
        # (lengths of the engine's containers: single reads, safe from another thread)
        metrics.running.set_function(lambda: len(self.engine.context.active))
        metrics.waiting.set_function(lambda: len(self.engine.scheduler.waiting) + self._inbox.qsize() + self.feed.pending)
        metrics.kv_usage.set_function(self._kv_usage)

    # ---------------------------------------------------------------- event-loop side
    def start(self) -> None:
        self._thread.start()

    def submit(self, sub: Submission) -> None:
        self._inbox.put(("add", sub))

    def abort(self, sub: Submission) -> None:
        self._inbox.put(("abort", sub))

    def run_admin(self, op: str, args: dict, reply: Callable[[tuple[int, dict]], None]) -> None:
        """Run the admin operation ``op`` (dp_engine/engine_ops.py) on the engine thread between two steps
        (the engine is never called from two threads); ``reply(status, body)`` is called there
        with its outcome. One that waits for another process (``Deferred``: a transfer group's
        set-up, an update's senders) replies later, the loop stepping meanwhile."""
        def job():
            if op in EVERY_RANK_OPS:
                self._tell_ranks(("admin", op, args))  # the other TP ranks run it too (follow_rank0)
            outcome = run_admin_op(self.engine, self._update_weights, op, args)
            if isinstance(outcome, Deferred):  # it waits off this thread: settled between two steps once done
                outcome.when_done(lambda: self.call(lambda: self._settle(op, outcome, reply)))
            else:
                reply(outcome)

        self.call(job)

    def _settle(self, op: str, deferred: Deferred, reply: Callable[[tuple[int, dict]], None]) -> None:
        if op in EVERY_RANK_OPS:
            self._tell_ranks(("settle", deferred.key))
        reply(deferred.settle())

    def call(self, job: Callable[[], None]) -> None:
        """``job()`` on the engine thread between two steps."""
        self._inbox.put(("call", job))

    async def admin(self, op: str, args: dict) -> tuple[int, dict]:
        """``run_admin`` from an event loop of this process: (HTTP status, JSON body)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self.run_admin(op, args, lambda outcome: loop.call_soon_threadsafe(_set_result, done, outcome))
        return await done

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def healthy(self) -> bool:
        """/health: the engine thread runs."""
        return self.is_alive()

    async def metrics_text(self) -> bytes:
        """/metrics: the registry rendered (its gauges read the engine's state now)."""
        return self.metrics.render()

    def adapter_names(self) -> list[str]:
        """The LoRA adapters loaded now, by name (one read of the engine's table: safe from any thread)."""
        adapters = self.engine.context.lora
        return [] if adapters is None else sorted(adapters.loaded)

    async def adapters(self) -> list[str] | None:
        """/v1/models and a request's ``model``: ``adapter_names``."""
        return self.adapter_names()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        """Every engine request belongs to a submission here, so ``_live`` says whether the
        engine has work (an aborted request stays live until its final output arrives)."""
        idle_timeout = TP_HEARTBEAT_S if self._comm is not None else None
        while True:
            commands = []
            try:  # idle: sleep until a command arrives; busy: take only what is already there
                busy = (self._live or self.feed.pending) and not self._paused_idle
                commands.append(self._inbox.get(block=not busy, timeout=None if busy else idle_timeout))
                while True:
                    commands.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            for kind, sub in commands:
                if kind == "stop":
                    self._tell_ranks("stop")
                    self._flush()
                    return
                self._paused_idle = False
                {"add": self._admit, "abort": self._abort, "call": lambda job: job()}[kind](sub)
            self._feed()
            self._hold()
            self._tell_ranks("step" if self._live else "idle")
            if self._live:
                self._step()
            self._observe_engine()
            self._flush()

    def _admit(self, sub: Submission) -> None:
        """All of a submission's choices are taken, or none (a bad one: rejected). They join the
        engine now when they fit (a bad one aborts those already added), else they are checked
        now and join in the fair order of fair_feed.py (request id -1 until then)."""
        n = len(sub.choices)
        if (why := self.engine.control.generation_blocked()) is not None:
            self._outbox.append((sub, "rejected", GenerationBlockedError(
                f"the engine cannot generate now: {why} (send it again once resumed; under a pause requests wait)")))
            return
        try:
            if self.feed.fits(n):
                for choice in sub.choices:
                    sub.request_ids.append(self.engine.add_request(choice.prompt_tokens, choice.params))
            else:
                for choice in sub.choices:
                    self.engine.validator.check(choice.prompt_tokens, choice.params)  # as add_request does
        except Exception as e:  # noqa: BLE001 -- InvalidRequestError is a 400; anything else must not kill the loop
            if not isinstance(e, InvalidRequestError):
                log.exception("add_request failed unexpectedly")
                e = RuntimeError(f"the engine could not admit this request: {type(e).__name__}: {e}")
            for rid in sub.request_ids:
                self.engine.abort_request(rid)
            self._outbox.append((sub, "rejected", e))
            return
        if sub.request_ids:
            self.feed.place(sub, n)
            for i, rid in enumerate(sub.request_ids):
                self._joined(sub, i, rid)
        else:
            sub.request_ids.extend([-1] * n)
            self.feed.add(sub, sub.choices[0].params.priority)
        self._outbox.append((sub, "admitted", list(sub.request_ids)))

    def _feed(self) -> None:
        """Choices waiting in the feed join the engine while it has places."""
        for sub, i in self.feed.take():
            choice = sub.choices[i]
            try:
                rid = self.engine.add_request(choice.prompt_tokens, choice.params)
            except Exception as e:  # noqa: BLE001 -- it was checked at admission: fail this choice, keep serving
                log.exception("add_request failed for a checked request")
                self.feed.ended(sub, i)
                self._outbox.append((sub, "event", ChoiceEvent(i, error=f"{type(e).__name__}: {e}")))
                continue
            sub.request_ids[i] = rid
            self._joined(sub, i, rid)

    def _hold(self) -> None:
        """The engine (every rank of it) holds the places above their body's share, from the
        next step on."""
        held = frozenset(sub.request_ids[i] for sub, i in self.feed.held())
        if held != self._held_ids:
            self._held_ids = held
            self._tell_ranks(("hold", sorted(held)))
            self.engine.scheduler.hold(held)

    def _joined(self, sub: Submission, index: int, rid: int) -> None:
        self._live[rid] = _Live(sub, index)
        self.metrics.prompt_tokens.inc(len(sub.choices[index].prompt_tokens))

    def _abort(self, sub: Submission) -> None:
        """Its choices in the engine are aborted there; those that never joined end here."""
        for i in self.feed.drop(sub):
            self.metrics.finished("abort")
            self._outbox.append((sub, "event", unsent_abort(sub, i)))
        for rid in sub.request_ids:
            if rid in self._live:
                self.engine.abort_request(rid)

    def _step(self) -> None:
        try:
            res = self.engine.step()
        except Exception as e:  # noqa: BLE001 -- fail the requests in flight, keep serving
            if (why := self.engine.control.generation_blocked()) is not None:  # they wait for a resume
                log.warning("%d requests wait until the engine resumes: %s", len(self._live), why)
                self._paused_idle = True
                return
            log.exception("engine step failed; failing %d requests", len(self._live))
            self._failed_steps += 1
            self._fail_all(f"engine step failed: {type(e).__name__}: {e}", forget=self._failed_steps >= MAX_FAILED_STEPS)
            return
        self._failed_steps = 0
        if res.step_id < 0 and not res.finished and not res.updates and self.engine.is_paused:
            self._paused_idle = True  # paused with nothing to land: sleep until a command comes
            return
        if res.step_id < 0 and not res.finished and not res.updates:  # the engine holds no request
            self._fail_all("the engine dropped this request", forget=True)  # never spin on requests it lost
            return
        self.steps += 1
        self.metrics.engine_steps.inc()
        now = time.perf_counter()
        lives, outbox, itl, tokens = self._live, self._outbox, self.metrics.itl, 0
        for upd in res.updates:
            live = lives.get(upd.request_id)
            if live is None or live.failed:
                continue
            n = len(upd.new_tokens)
            if n:
                if live.last_token_at is None:
                    self.metrics.ttft.observe(now - live.submission.arrival)
                else:
                    for _ in range(n):
                        itl.observe((now - live.last_token_at) / n)
                live.last_token_at = now
                live.num_tokens += n
                tokens += n
            outbox.append((live.submission, "event", ChoiceEvent(live.index, upd)))
        if tokens:
            self.metrics.generation_tokens.inc(tokens)
        for out in res.finished:
            live = self._live.pop(out.request_id, None)
            if live is not None:
                self.feed.ended(live.submission, live.index)
            if live is None or live.failed:
                continue
            self.metrics.e2e.observe(now - live.submission.arrival)
            self.metrics.finished(out.finish_reason)
            self._outbox.append((live.submission, "event", ChoiceEvent(live.index, output=out)))

    def _fail_all(self, message: str, forget: bool = False) -> None:
        """Tell every live request's handler it failed and abort it in the engine; ``forget``:
        also stop stepping for them (the engine lost them, or keeps failing)."""
        for rid, live in list(self._live.items()):
            if not live.failed:
                self._outbox.append((live.submission, "event", ChoiceEvent(live.index, error=message)))
                live.failed = True
                try:
                    self.engine.abort_request(rid)
                except Exception:  # noqa: BLE001 -- best effort: the request is failed either way
                    log.exception("abort of request %d failed", rid)
        if forget:
            for live in self._live.values():
                self.feed.ended(live.submission, live.index)
            self._live.clear()

    def _tell_ranks(self, command: str) -> None:
        if self._comm is not None:
            self._comm.broadcast_object(command)

    def _kv_usage(self) -> float:
        alloc = self.engine.context.allocator
        return 1.0 - alloc.num_available / alloc.capacity if alloc.capacity else 0.0

    def _observe_engine(self) -> None:
        m, st = self.metrics, self.engine.stats
        m.overlap_ratio.set(st.overlap_ratio)
        m.decode_steps.set(st.decode_steps)
        m.overlapped_decode_steps.set(st.overlapped_decode_steps)
        m.prefill_tokens.set(st.prefill_tokens)
        m.shared_prompt_tokens.set(st.shared_prompt_tokens)
        m.held_steps.set(st.held_steps)

    def _flush(self) -> None:
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        by_key: dict[Any, tuple[Any, list]] = {}  # one call per event loop or front-end, entries in order
        for entry in batch:
            sink = entry[0].sink
            by_key.setdefault(sink.batch_key, (sink, []))[1].append(entry)
        for sink, mine in by_key.values():
            sink.deliver(mine)

