"""The engine process's side of its HTTP front-end processes (frontend.py): a thread that takes
their messages (ipc.py) and turns them into the engine loop's commands, and one sink per
front-end through which the engine thread sends each step's results.

The bridge thread never waits for a step: it answers /metrics, /health and adapter-list queries itself (the
gauges read the engine's state at that moment) and only puts adds, aborts and admin operations
into the engine loop's inbox. It watches every front-end process; when one exits it aborts
that front-end's requests (their KV blocks come back) and the others keep serving.

Its socket takes only front-ends that proved the server's secret (communication/handshake.py,
role "frontend", names "0" .. "N-1", each bound once) and only the messages a front-end sends
(``ipc.FRONTEND_SENDS``), each through its checked reader: any other frame is dropped and
counted in ``wire_stats`` (``/metrics``: megatron_async_frontend_ipc_dropped_frames_total by
reason) and the bridge goes on. Each front-end's requests, handed over and running, are counted
on ``/metrics`` too (``frontend`` label: its index): how evenly the front-ends share the load."""
from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from megatron_async.dp_engine.engine_ops import error_body
from megatron_async.inference.communication import wire
from megatron_async.inference.communication.handshake import Listener
from megatron_async.inference.request import InvalidRequestError
from megatron_async.serve import ipc
from megatron_async.serve.engine_loop import EngineLoop
from megatron_async.serve.submission import Choice

log = logging.getLogger("megatron_async.serve")
POLL_S = 0.5


class FrontendSink:
    """Where the engine thread sends the results of one front-end's submissions: one message
    per step (``deliver``, on the engine thread, which alone uses ``sock``)."""

    def __init__(self, index: int, sock: zmq.Socket):
        self.index = self.batch_key = index  # batch_key: see submission.LoopSink
        self.sock = sock
        self.live: dict[int, RemoteSubmission] = {}
        """This front-end's submissions not yet ended, by sid (the bridge adds, the engine thread
        removes at a submission's last event; single dict operations, safe between threads)."""
        self.gone = False
        """The front-end process exited: nothing more is sent."""
        self.requests = 0
        """Submissions it handed over (``/metrics``: megatron_async_frontend_requests_total)."""

    def deliver(self, batch: list[tuple[Any, str, Any]]) -> None:
        entries = []
        for target, kind, payload in batch:
            if kind == "rejected" or (kind == "event" and payload.is_last and target.ended_choice()):
                self.live.pop(target.sid, None)
            entries.append((target.sid, kind, payload))
        if self.gone:
            if not self.sock.closed:
                self.sock.close(0)
            return
        # never blocks (no send limit); sent before the front-end's socket is up, it waits in ZMQ's queue
        self.sock.send(ipc.encode_entries(entries))


@dataclass(eq=False)
class RemoteSubmission:
    """A front-end's submission as the engine loop sees it (what submission.Submission is to
    an event loop of this process)."""

    sid: int
    choices: list[Choice]
    arrival: float
    sink: FrontendSink
    request_ids: list[int] = field(default_factory=list)
    open_choices: int = 0

    def __post_init__(self):
        self.open_choices = len(self.choices)

    def ended_choice(self) -> bool:
        """One choice had its last event; True when it was the last open one."""
        self.open_choices -= 1
        return self.open_choices <= 0


@dataclass(frozen=True)
class _Answer:
    sid: int
    sink: FrontendSink


class Bridge:
    """``Bridge(engine_loop, endpoints, count, max_frame_bytes)``: binds the sockets of ``count``
    front-ends, which join with ``secret`` (random, one per server); ``watch(i, pid)`` each
    one's process; ``start()``; ``wait_ready()``; ``stop()``."""

    def __init__(self, engine_loop: EngineLoop, endpoints: ipc.Endpoints, count: int, max_frame_bytes: int,
                 on_all_gone: Callable[[], None] | None = None):
        self.engine_loop = engine_loop
        self._on_all_gone = on_all_gone
        self.secret = secrets.token_bytes(32)
        """What a front-end proves to join (it travels in the front-end's stdin)."""
        self.wire_stats = wire.WireStats()
        """Frames the bridge's socket received and dropped (every front-end's, and strangers')."""
        engine_loop.metrics.count_dropped_frames("frontend_ipc", self.wire_stats)
        self._ctx = zmq.Context()
        self._router = ipc.socket(self._ctx, zmq.ROUTER)
        self._listener = Listener(self._router, self.secret, {ipc.ROLE: [str(i) for i in range(count)]},
                                  job=endpoints.job, max_frame_bytes=max_frame_bytes, stats=self.wire_stats)
        self._router.bind(endpoints.bridge)
        self._handlers = {ipc.READY: self._ready_message, ipc.ADD: self._add, ipc.ABORT: self._abort,
                          ipc.QUERY: self._query, ipc.ADMIN: self._admin}
        """Message type -> its handler(sink, peer, *fields): ``ipc.FRONTEND_SENDS``."""
        self.sinks = []
        for i in range(count):  # connected, not bound: a message waits until front-end i binds its end
            sock = ipc.socket(self._ctx, zmq.PUSH)
            sock.setsockopt(zmq.RECONNECT_IVL, 10)
            sock.connect(endpoints.events(i))
            self.sinks.append(FrontendSink(i, sock))
        engine_loop.metrics.count_frontend_requests(self.sinks)
        self._wake_in = self._ctx.socket(zmq.PAIR)
        self._wake_in.bind(f"inproc://bridge-wake-{id(self)}")
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.connect(f"inproc://bridge-wake-{id(self)}")
        self._pidfds: dict[int, int] = {}
        """pidfd (readable once the process exited) -> front-end index."""
        self._polled: dict[int, Any] = {}
        """Front-end index -> its process, where pidfds are missing (checked every ``POLL_S``)."""
        self._ready: set[int] = set()
        self._ready_event = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="megatron-async-bridge", daemon=True)

    def watch(self, index: int, process) -> None:
        """Before ``start``: abort front-end ``index``'s requests when ``process`` (a Popen) exits."""
        try:
            self._pidfds[os.pidfd_open(process.pid)] = index
        except (AttributeError, OSError):  # not Linux >= 5.3
            self._polled[index] = process

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float, alive: Callable[[], bool]) -> bool:
        """Until every front-end said it serves (True), one exited (``alive()`` False) or the time is up."""
        deadline = time.monotonic() + timeout
        while not self._ready_event.wait(0.05):
            if not alive() or time.monotonic() > deadline:
                return False
        return True

    def expect_exits(self) -> None:
        """The front-ends are told to stop: their exits are no failure (their requests are still aborted)."""
        self._stopping = True

    def stop(self) -> None:
        """After the front-ends exited: the thread ends, the sockets close."""
        self._stopping = True
        if self._thread.is_alive():
            self._wake.send(b"")
            self._thread.join(10)
        self._listener.close()
        for sock in (self._router, self._wake, self._wake_in, *(s.sock for s in self.sinks)):
            if not sock.closed:
                sock.close(0)
        for fd in self._pidfds:
            os.close(fd)
        self._ctx.term()

    # ---------------------------------------------------------------- bridge thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._listener.monitor, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        for fd in self._pidfds:
            poller.register(fd, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(1000 * POLL_S if self._polled else None))
            if self._wake_in in ready:
                return
            if self._router in ready:
                self._take_messages()
            if self._listener.monitor in ready:
                self._listener.lost()  # (a front-end's exit is seen through its process)
            for fd in [fd for fd in ready if isinstance(fd, int)]:
                poller.unregister(fd)
                self._gone(self._pidfds[fd])
            for index in [i for i, p in self._polled.items() if p.poll() is not None]:
                del self._polled[index]
                self._gone(index)

    def _take_messages(self) -> None:
        for peer, mtype, fields in self._listener.take():  # authenticated front-ends' decoded frames
            handler = self._handlers.get(mtype)
            if handler is None:
                self.wire_stats.drop("wrong role")
                continue
            sink = self.sinks[int(peer.name)]
            try:
                checked = mtype.read(fields)
            except wire.WireError as e:
                self.wire_stats.drop(e.reason)
                self._refuse(sink, mtype, fields, e)
                continue
            if sink.gone:
                continue
            try:
                handler(sink, peer, *checked)
            except Exception:  # noqa: BLE001 -- one bad message must not end the bridge
                log.exception("front-end message failed")

    def _refuse(self, sink: FrontendSink, mtype: wire.MessageType, fields: list, e: wire.WireError) -> None:
        """A front-end's add or admin call that its reader refused is answered (by the engine
        thread, the sink's sender), so that its handler does not wait for ever."""
        sid = fields[0] if fields and type(fields[0]) is int else None
        if sid is None or mtype not in (ipc.ADD, ipc.ADMIN):
            return
        target = _Answer(sid, sink)
        if mtype is ipc.ADD:
            answer = (target, "rejected", InvalidRequestError(f"the engine's process could not read this request: {e}"))
        else:
            answer = (target, "admin", (400, error_body(f"the engine's process could not read these arguments: {e}", 400)))
        self.engine_loop.call(lambda: sink.deliver([answer]))

    def _add(self, sink: FrontendSink, peer, sid: int, arrival: float, choices: list[Choice]) -> None:
        sub = RemoteSubmission(sid, choices, arrival, sink)
        sink.live[sid] = sub
        sink.requests += 1
        self.engine_loop.submit(sub)

    def _abort(self, sink: FrontendSink, peer, sid: int) -> None:
        sub = sink.live.get(sid)
        if sub is not None:
            self.engine_loop.abort(sub)

    def _query(self, sink: FrontendSink, peer, sid: int, what: str) -> None:
        if what == "metrics":
            value = self.engine_loop.metrics.render()
        elif what == "adapters":
            value = json.dumps(self.engine_loop.adapter_names()).encode()
        else:
            value = self.engine_loop.is_alive()
        self._listener.send(peer, wire.encode(ipc.REPLY, sid, value))

    def _admin(self, sink: FrontendSink, peer, sid: int, op: str, args: dict) -> None:
        target = _Answer(sid, sink)
        self.engine_loop.run_admin(op, args, lambda outcome: sink.deliver([(target, "admin", outcome)]))

    def _ready_message(self, sink: FrontendSink, peer) -> None:
        self._ready.add(sink.index)
        if len(self._ready) == len(self.sinks):
            self._ready_event.set()

    def _gone(self, index: int) -> None:
        sink = self.sinks[index]
        sink.gone = True
        subs = list(sink.live.values())
        if not self._stopping:
            log.error("HTTP front-end %d exited; aborting its %d requests", index, len(subs))
        for sub in subs:
            self.engine_loop.abort(sub)
        if all(s.gone for s in self.sinks) and self._on_all_gone is not None and not self._stopping:
            self._on_all_gone()
