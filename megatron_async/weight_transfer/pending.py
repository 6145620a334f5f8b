"""A transfer-group operation whose wait for the other side runs off the engine thread: the
set-up of the group (every rank joins) and the begin frame of an update (the trainer's senders
arrive). The wait runs on a daemon thread of its own and resolves a ``concurrent.futures.Future``;
what follows it (keep the group, copy the buckets) runs where ``finish`` is called, which the
engine's loops do on the engine thread between two steps once the future is done, so the loop
keeps stepping meanwhile. The wait is bounded by the group's torch timeouts; ``finish`` gives up
after ``bound_s`` in any case."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Callable

from megatron_async.weight_transfer.group import TransferFailed


class PendingTransfer:
    def __init__(self, what: str, wait: Callable[[], Any], finish: Callable[[Any, BaseException | None], Any],
                 bound_s: float, discard: Callable[[Any], None] | None = None):
        """``what``: the operation in words ("a transfer group set-up to HOST:PORT"); ``wait()``
        runs on a thread of its own; ``finish(result, error)`` (one of them None) gives the
        operation's outcome on the calling thread; ``discard(result)``: what to do with a result
        that arrives after ``finish`` gave up on it."""
        self.what, self.bound_s = what, bound_s
        self.future: Future = Future()
        self._finish, self._discard = finish, discard
        threading.Thread(target=self._run, args=(wait,), name="megatron-async-weight-transfer", daemon=True).start()

    def _run(self, wait: Callable[[], Any]) -> None:
        self.future.set_running_or_notify_cancel()
        try:
            self.future.set_result(wait())
        except BaseException as e:  # noqa: BLE001 -- handed to finish on the engine thread
            self.future.set_exception(e)

    def done(self) -> bool:
        return self.future.done()

    def when_done(self, callback: Callable[[], None]) -> None:
        """``callback()`` once the wait ended (on the waiting thread, or now if it has)."""
        self.future.add_done_callback(lambda _: callback())

    def finish(self) -> Any:
        """The operation's outcome (raises its error); waits up to ``bound_s`` for the wait to end."""
        wait_futures([self.future], timeout=self.bound_s)
        if not self.future.done():
            if self._discard is not None:
                discard = self._discard
                self.future.add_done_callback(lambda f: f.exception() is None and discard(f.result()))
            return self._finish(None, TransferFailed(f"{self.what} did not end within {self.bound_s:g} s"))
        error = self.future.exception()
        return self._finish(None if error is not None else self.future.result(), error)
