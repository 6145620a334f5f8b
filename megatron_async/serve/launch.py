"""Start, run and stop the HTTP side of a server whose engine runs in this process (``python -m
megatron_async.serve``, and benchmarks/commands/server_breakdown.py, which serves the same way).

``api_server_count`` 0: uvicorn and the app on this process's event loop, beside the engine
thread (one GIL for both). N >= 1: N front-end processes (frontend.py) each run uvicorn and the
app on a listening socket of its own on the one port (``bind_group``), and a bridge thread
(bridge.py) connects them to the engine loop; this process keeps only the engine thread busy.
Stop (SIGTERM / Ctrl-C, or ``request_stop``): the front-ends stop taking requests and give those
in flight ``GRACEFUL_SHUTDOWN_S``; then the engine loop and the bridge stop. uvicorn's server, as
either process runs it (``uvicorn_server``): on a socket bound beforehand, shut down gracefully
on SIGTERM / Ctrl-C, and returning afterwards instead of re-raising the signal."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from megatron_async.serve import ipc

log = logging.getLogger("megatron_async.serve")
GRACEFUL_SHUTDOWN_S = 5
"""On SIGTERM / Ctrl-C, requests in flight get this long to finish before their connections close."""
FRONTEND_START_TIMEOUT_S = 120.0
BACKLOG = 2048
"""Connections made after the ready line queue until uvicorn accepts them."""


def bind_group(host: str, port: int, count: int, share_port: bool = True) -> list[socket.socket]:
    """``count`` listening sockets on one port, one per front-end process. On Linux they form an
    SO_REUSEPORT group: the kernel deals each new connection to one of them by a hash of its
    addresses, evenly whatever the processes do. Sharing one socket instead, whichever process
    wakes first accepts every connection waiting, and keep-alive connections opened together stay
    with it (docs/PERFORMANCE.md, "Serving": python -m benchmarks frontend-split). The first
    socket allows the group only once bound, so a port another server holds is refused as
    before; only this user's sockets can join. Elsewhere (other systems' SO_REUSEPORT does not
    balance), or ``share_port`` False: one socket, ``count`` times. OSError: the port cannot be
    bound."""
    first = _bound(host, port)
    socks = [first]
    if share_port and count > 1 and sys.platform.startswith("linux"):
        try:
            first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            while len(socks) < count:
                socks.append(_bound(host, first.getsockname()[1], reuse_port=True))
        except OSError as e:
            log.warning("the HTTP front-ends share one listening socket (SO_REUSEPORT: %s)", e)
            for sock in socks[1:]:
                sock.close()
            socks = [first]
            with contextlib.suppress(OSError):
                first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 0)
    try:
        for sock in socks:
            sock.listen(BACKLOG)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks if len(socks) == count else socks * count


def _bound(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def serve_until_stopped(serving: Serving, host: str, port: int, also: str = "") -> int:
    """Start ``serving``, print ``megatron_async.serve: serving NAME on URL`` (+ ``also``) once it
    takes requests, run it until stopped and close it: the exit code (1: it could not start)."""
    try:
        try:
            serving.start()
        except OSError as e:
            print(f"error: cannot listen on {host}:{port}: {e}", file=sys.stderr)
            return 1
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"megatron_async.serve: serving {serving.state.model_name} on {serving.url}{also}", flush=True)
        return serving.run()
    finally:
        serving.close()


class Serving:
    """``s = Serving(state, host, port, api_server_count)``; ``url = s.start()``; ``s.run()``
    (blocks until stopped); ``s.close()``. ``state``: app.py's ServerState with the engine loop."""

    def __init__(self, state, host: str, port: int, api_server_count: int = 1, log_level: str = "warning",
                 http: str = "auto", loop: str = "auto", share_port: bool = True):
        """``share_port`` False: the front-ends share one listening socket (``bind_group``)."""
        self.state, self.host, self.port = state, host, port
        self.api_server_count, self.share_port = api_server_count, share_port
        self.log_level, self.http, self.loop = log_level, http, loop
        self.frontends: list[subprocess.Popen] = []
        self.url = ""
        self._socks: list[socket.socket] = []
        """The listening sockets, one per front-end (the same one each time where they share one)."""
        self._server = None
        self._bridge = None
        self._endpoints: ipc.Endpoints | None = None
        self._stop = threading.Event()
        self._all_gone = False

    # ---------------------------------------------------------------- start
    def start(self) -> str:
        """Listen, start the engine loop and the front-ends (waiting until each listens);
        the server's URL. OSError: the address cannot be bound; RuntimeError: a front-end failed."""
        self._socks = bind_group(self.host, self.port, max(1, self.api_server_count), self.share_port)
        scheme = "https" if self.state.policy.ssl_certfile else "http"
        self.url = f"{scheme}://{self.host}:{self._socks[0].getsockname()[1]}"
        self.state.engine_loop.start()
        if self.api_server_count == 0:
            from megatron_async.serve.app import create_app

            self._server = uvicorn_server(create_app(self.state), self.log_level, self.http, self.loop,
                                          policy=self.state.policy)
            return self.url
        from megatron_async.serve.bridge import Bridge

        self._endpoints = ipc.Endpoints.create()
        self._bridge = Bridge(self.state.engine_loop, self._endpoints, self.api_server_count,
                              ipc.max_frame_bytes(self.state.max_request_bytes), self._on_all_gone)
        for i in range(self.api_server_count):
            self.frontends.append(self._spawn(i))
            self._bridge.watch(i, self.frontends[-1])
        self._bridge.start()
        if not self._bridge.wait_ready(FRONTEND_START_TIMEOUT_S, lambda: all(p.poll() is None for p in self.frontends)):
            codes = [p.poll() for p in self.frontends]
            raise RuntimeError(f"the HTTP front-end processes did not start (exit codes {codes})")
        # the front-ends hold the listening sockets now: once one has closed its own, new
        # connections go to the others' (once all have, they are refused) rather than waiting
        # in a backlog nobody accepts from
        self._close_sockets()
        return self.url

    def _spawn(self, index: int) -> subprocess.Popen:
        st = self.state
        template = st.chat_template
        config = ipc.FrontendConfig(
            index=index, directory=self._endpoints.directory, secret=self._bridge.secret,
            fd=self._socks[index].fileno(), parent_pid=os.getpid(),
            model_name=st.model_name, tokenizer=st.tokenizer,
            chat_template=(template.source, template.special_tokens) if template is not None else None,
            max_model_len=st.max_model_len, max_requests=st.max_requests, max_request_bytes=st.max_request_bytes,
            created=st.created, tool_call_parser=st.tool_call_parser, reasoning_parser=st.reasoning_parser,
            admin_endpoints=st.admin_endpoints, policy=st.policy, log_level=self.log_level, http=self.http,
            loop=self.loop, grammars=st.grammars.settings() if st.grammars is not None else None)
        root = str(Path(__file__).resolve().parents[2])  # this tree's package, whatever the caller's sys.path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.Popen([sys.executable, "-m", "megatron_async.serve.frontend"], stdin=subprocess.PIPE,
                                pass_fds=(self._socks[index].fileno(),), env=env)
        proc.stdin.write(config.to_json())
        proc.stdin.close()
        return proc

    # ---------------------------------------------------------------- run and stop
    def run(self) -> int:
        """Serve until SIGTERM / Ctrl-C (on the main thread) or ``request_stop``; 1 when every
        front-end process exited on its own, else 0."""
        if self._server is not None:
            self._server.run(sockets=self._socks)
            return 0
        on_main = threading.current_thread() is threading.main_thread()
        previous = {}
        if on_main:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda *_: self._stop.set())
        try:
            while not self._stop.wait(0.5):
                pass
            self._stop_frontends()  # a second Ctrl-C while they finish changes nothing here
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 1 if self._all_gone else 0

    def request_stop(self) -> None:
        """From any thread: ``run`` returns after the graceful shutdown."""
        if self._server is not None:
            self._server.should_exit = True
        self._stop.set()

    def _on_all_gone(self) -> None:
        log.error("every HTTP front-end process exited; the server stops")
        self._all_gone = True
        self._stop.set()

    def _stop_frontends(self) -> None:
        if self._bridge is not None:
            self._bridge.expect_exits()
        for p in self.frontends:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACEFUL_SHUTDOWN_S + 5
        for p in self.frontends:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("HTTP front-end %d did not stop; killed", p.pid)
                p.kill()
                p.wait()

    def close(self) -> None:
        """Stop everything (also after a failed ``start``): front-ends, bridge, engine loop."""
        self._stop_frontends()
        if self.state.engine_loop.is_alive():
            self.state.engine_loop.stop()
        if self._bridge is not None:  # after the engine thread, the last user of the sinks' sockets
            self._bridge.stop()
        if self._endpoints is not None:
            self._endpoints.remove()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in set(self._socks):
            sock.close()


# ---------------------------------------------------------------- uvicorn
def uvicorn_server(app, log_level: str, http: str = "auto", loop: str = "auto",
                   on_started: Callable[[], None] | None = None, stop_on_sigint: bool = True, policy=None):
    """A uvicorn server of ``app``; ``on_started`` runs on its event loop once it listens;
    ``policy``: the HttpPolicy (http_guard.py) whose TLS files it serves with.
    ``stop_on_sigint`` False: only SIGTERM stops it (a front-end process: Ctrl-C reaches the whole
    process group, and the engine's process passes it on as a SIGTERM; taking both would turn
    the second into uvicorn's forced exit)."""
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and on_started is not None:
                on_started()

        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGINT and not stop_on_sigint:
                return
            super().handle_exit(sig, frame)
            # shut down gracefully and return: uvicorn would re-raise the signal once serving
            # ends, killing the process before the engine thread and the model are closed
            getattr(self, "_captured_signals", []).clear()

    tls = {} if policy is None else {"ssl_keyfile": policy.ssl_keyfile, "ssl_certfile": policy.ssl_certfile}
    config = uvicorn.Config(app, log_level=log_level, access_log=False, http=http, loop=loop,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **tls)  # (configures uvicorn's loggers)
    error_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, ClientFaultsAtInfo) for f in error_log.filters):
        error_log.addFilter(ClientFaultsAtInfo())
    return Server(config)


class ClientFaultsAtInfo(logging.Filter):
    """uvicorn's lines about a client's own broken request (malformed HTTP or chunked body, an
    upgrade nobody serves) are INFO, not WARNING: a stranger's garbage is not the server's fault,
    and at the default log level it costs no line at all."""

    MESSAGES = ("Invalid HTTP request received.", "Unsupported upgrade request.", "No supported WebSocket library")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and record.getMessage().startswith(self.MESSAGES):
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True
