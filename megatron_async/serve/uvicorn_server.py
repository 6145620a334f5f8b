"""uvicorn's server as the engine process (``--api-server-count 0``) and each front-end process
run it: on a socket bound beforehand, shut down gracefully on SIGTERM / Ctrl-C, and returning
afterwards instead of re-raising the signal."""
from __future__ import annotations

from typing import Callable

GRACEFUL_SHUTDOWN_S = 5
"""On SIGTERM / Ctrl-C, requests in flight get this long to finish before their connections close."""


def uvicorn_server(app, log_level: str, http: str = "auto", loop: str = "auto",
                   on_started: Callable[[], None] | None = None, stop_on_sigint: bool = True):
    """A uvicorn server of ``app``; ``on_started`` runs on its event loop once it listens.
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

    return Server(uvicorn.Config(app, log_level=log_level, access_log=False, http=http, loop=loop,
                                 timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
