"""An HTTP front-end process (``--api-server-count N``): uvicorn and the app (app.py) on the
listening socket the engine's process bound for it (launch.py's ``bind_group``), with
``RemoteEngineLoop`` in place of the engine loop. The engine's process starts it as
``python -m megatron_async.serve.frontend`` and writes its ``FrontendConfig`` (ipc.py,
JSON) to its stdin; it joins the engine process's bridge with the secret in it (the handshake)
and says ``ready`` once it listens.

A handler submits, aborts and asks exactly as it would in the engine's process; the stand-in
sends those as messages (ipc.py) and files each step's message from the engine thread into the
same ``Submission`` objects (the admitted future, the events queue). Both sockets are read from
the event loop itself (``add_reader``): no thread of its own competes for this process's GIL. A
frame that is not a valid message of its socket is dropped and counted (``wire_stats``, and
one warning per reason); a message too large for the bridge is refused here (400)."""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import json
import logging
import os
import socket
import sys

import zmq

from megatron_async.dp_engine.engine_ops import error_body
from megatron_async.inference.communication import wire
from megatron_async.inference.communication.handshake import AuthError, authenticate
from megatron_async.inference.request import InvalidRequestError
from megatron_async.serve import ipc
from megatron_async.serve.submission import Submission, _deliver, _set_result

log = logging.getLogger("megatron_async.serve")
PROFILER_ENV = "MEGATRON_ASYNC_FRONTEND_PROFILER"
"""``module:function``: the process imports it and runs its event loop inside ``function(index)``, a
context manager (a profiler of the front-end's own, e.g. ``python -m benchmarks server-breakdown``'s
stage sampler); the module must be importable from the front-end's working directory."""
QUERY_TIMEOUT_S = 5.0
"""/health answers 503 when the engine's process does not answer within this long."""
PARENT_CHECK_S = 1.0


class RemoteEngineLoop:
    """The engine loop's interface as app.py uses it (submit / abort / admin / healthy /
    metrics_text / adapters), for an engine in another process. ``attach`` on the serving event loop."""

    def __init__(self, endpoints: ipc.Endpoints, index: int, secret: bytes, max_frame_bytes: int):
        """Joins the bridge (``AuthError``: it does not hold ``secret``, or nobody answers)."""
        self._ctx = zmq.Context()
        self._out = ipc.socket(self._ctx, zmq.DEALER)
        self._events = ipc.socket(self._ctx, zmq.PULL)
        self._out.connect(endpoints.bridge)
        self._events.bind(endpoints.events(index))
        self.max_frame_bytes = max_frame_bytes
        self.wire_stats = wire.WireStats()
        """Frames from the engine's process (or anyone else) dropped by this front-end."""
        self._ids = itertools.count()
        self._subs: dict[int, list] = {}
        """sid -> [submission, choices without their last event]."""
        self._waiting: dict[int, asyncio.Future] = {}
        """sid of an admin call or query -> its future."""
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            authenticate(self._out, secret, ipc.ROLE, str(index), endpoints.job)
        except AuthError:
            self.close()
            raise

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._events.getsockopt(zmq.FD), self._take_events)
        loop.add_reader(self._out.getsockopt(zmq.FD), self._take_replies)
        self._send(wire.encode(ipc.READY))

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for sock in (self._events, self._out):
                self._loop.remove_reader(sock.getsockopt(zmq.FD))
        self._events.close(0)
        self._out.close(0)
        self._ctx.term()

    # ---------------------------------------------------------------- what app.py calls
    def submit(self, sub: Submission) -> None:
        sid = next(self._ids)
        sub.sid = sid
        frame = self._frame(ipc.encode_add, sid, sub.choices, sub.arrival)
        if isinstance(frame, str):
            sub.admitted.set_exception(InvalidRequestError(f"this request cannot be handed to the engine: {frame}"))
            return
        self._subs[sid] = [sub, len(sub.choices)]
        self._send(frame)

    def abort(self, sub: Submission) -> None:
        sid = getattr(sub, "sid", None)
        if sid in self._subs:  # a no-op for an ended submission (every stream's end calls it)
            self._send(wire.encode(ipc.ABORT, sid))

    async def admin(self, op: str, args: dict) -> tuple[int, dict]:
        sid = next(self._ids)
        frame = self._frame(wire.encode, ipc.ADMIN, sid, op, args)
        if isinstance(frame, str):
            return 400, error_body(f"these arguments cannot be handed to the engine: {frame}", 400)
        return await self._ask(sid, frame)

    async def healthy(self) -> bool:
        try:
            sid = next(self._ids)
            return bool(await asyncio.wait_for(self._ask(sid, wire.encode(ipc.QUERY, sid, "health")), QUERY_TIMEOUT_S))
        except asyncio.TimeoutError:
            return False

    async def metrics_text(self) -> bytes:
        sid = next(self._ids)
        return await asyncio.wait_for(self._ask(sid, wire.encode(ipc.QUERY, sid, "metrics")), QUERY_TIMEOUT_S)

    async def adapters(self) -> list[str] | None:
        """The LoRA adapters the engine holds now (asked each time: another front-end may load one)."""
        sid = next(self._ids)
        raw = await asyncio.wait_for(self._ask(sid, wire.encode(ipc.QUERY, sid, "adapters")), QUERY_TIMEOUT_S)
        try:
            names = json.loads(raw)
        except (TypeError, ValueError):
            names = None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RuntimeError("the engine's process answered the adapter list with something else")
        return names

    # ---------------------------------------------------------------- sockets
    def _frame(self, encode, *fields) -> bytes | str:
        """``encode(*fields)``, or why the bridge would not take it (too large, or a value the
        wire cannot carry): said here, so that no caller waits for an answer that never comes."""
        try:
            frame = encode(*fields)
        except (TypeError, ValueError, OverflowError) as e:  # msgpack: nesting over its limit, ints over 64 bits
            return f"{type(e).__name__}: {e}"
        if len(frame) > self.max_frame_bytes:
            return f"{len(frame)} bytes on the wire, over {self.max_frame_bytes}"
        return frame

    async def _ask(self, sid: int, frame: bytes):
        done = self._waiting[sid] = asyncio.get_running_loop().create_future()
        self._send(frame)
        try:
            return await done
        finally:
            self._waiting.pop(sid, None)

    def _dropped(self, e: wire.WireError) -> None:
        self.wire_stats.drop(e.reason)
        if self.wire_stats.dropped[e.reason] == 1:
            log.warning("dropped a frame that is not a valid message (%s); such frames are counted, not logged", e)

    def _send(self, frame: bytes) -> None:
        self._out.send(frame)
        # a send can take the socket's readable edge: read what came in, or it waits for the next edge
        if self._loop is not None and self._out.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon(self._take_replies)

    def _take_replies(self) -> None:
        while True:
            try:
                frame = self._out.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                mtype, fields = wire.decode(frame, self.max_frame_bytes)
                if mtype is not ipc.REPLY:
                    raise wire.WireError("wrong role", mtype.name)
                sid, value = mtype.read(fields)
            except wire.WireError as e:
                self._dropped(e)
                continue
            if sid in self._waiting:
                _set_result(self._waiting[sid], value)

    def _take_events(self) -> None:
        """Every step message waiting (all of them: the socket signals only a new edge)."""
        while True:
            try:
                message = self._events.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                entries = ipc.decode_entries(message)
            except wire.WireError as e:
                self._dropped(e)
                continue
            try:
                self._file(entries)
            except Exception:  # noqa: BLE001 -- keep reading: the next messages must not wait for a new edge
                log.exception("a step message from the engine could not be filed")

    def _file(self, entries: list) -> None:
        """One step's entries into their submissions (``submission._deliver``, in order) and
        admin calls; a submission is forgotten at its rejection or its last choice's end."""
        subs, batch = self._subs, []
        for sid, kind, payload in entries:
            if kind == "admin":
                if sid in self._waiting:
                    _set_result(self._waiting[sid], payload)
                continue
            entry = subs.get(sid)
            if entry is None:
                continue
            batch.append((entry[0], kind, payload))
            if kind == "rejected":
                del subs[sid]
            elif kind == "event" and payload.is_last:
                entry[1] -= 1
                if entry[1] <= 0:
                    del subs[sid]
        _deliver(batch)


def _watch_parent(server, parent_pid: int) -> None:
    """The engine's process is gone (killed): its requests are dead, stop at once."""
    if os.getppid() != parent_pid:
        log.error("the engine's process exited; this front-end stops")
        server.should_exit = server.force_exit = True
        return
    asyncio.get_running_loop().call_later(PARENT_CHECK_S, _watch_parent, server, parent_pid)


def main() -> int:
    config = ipc.FrontendConfig.from_json(sys.stdin.buffer.read())
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(name)s[front-end {config.index}] %(levelname)s %(message)s")
    from megatron_async.models.chat_template import ChatTemplate
    from megatron_async.serve.app import ServerState, create_app
    from megatron_async.serve.launch import uvicorn_server

    sock = socket.socket(fileno=config.fd)
    try:
        remote = RemoteEngineLoop(ipc.Endpoints(config.directory), config.index, config.secret,
                                  ipc.max_frame_bytes(config.max_request_bytes))
    except AuthError as e:
        log.error("cannot join the engine's process: %s", e)
        return 1
    state = ServerState(
        engine_loop=remote, model_name=config.model_name, tokenizer=config.tokenizer,
        chat_template=ChatTemplate(*config.chat_template) if config.chat_template else None,
        max_model_len=config.max_model_len, max_requests=config.max_requests,
        max_request_bytes=config.max_request_bytes, created=config.created, tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser, admin_endpoints=config.admin_endpoints, policy=config.policy)
    if config.grammars is not None and config.tokenizer is not None:
        from megatron_async.inference.structured.grammars import Grammars

        state.grammars = Grammars(config.tokenizer.backend_tokenizer, *config.grammars)

    def started() -> None:
        loop = asyncio.get_running_loop()
        remote.attach(loop)
        _watch_parent(server, config.parent_pid)

    server = uvicorn_server(create_app(state), config.log_level, config.http, config.loop, on_started=started,
                            stop_on_sigint=False, policy=config.policy)
    try:
        with _profiler(config.index):
            server.run(sockets=[sock])
    finally:
        remote.close()
    return 0


def _profiler(index: int):
    """The context manager ``PROFILER_ENV`` names, or one that does nothing."""
    spec = os.environ.get(PROFILER_ENV)
    if not spec:
        return contextlib.nullcontext()
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)(index)


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
