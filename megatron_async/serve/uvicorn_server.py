"""uvicorn's server as the engine process (``--api-server-count 0``) and each front-end process
run it: on a socket bound beforehand, shut down gracefully on SIGTERM / Ctrl-C, and returning
afterwards instead of re-raising the signal."""
from __future__ import annotations

import logging
from typing import Callable

GRACEFUL_SHUTDOWN_S = 5
"""On SIGTERM / Ctrl-C, requests in flight get this long to finish before their connections close."""


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
