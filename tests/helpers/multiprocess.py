"""Run a function on N local "ranks" (processes) with a torchrun-like environment, with a hard
deadline, so that multi-rank tests can neither hang nor hide a child's traceback."""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from multiprocessing import reduction
from typing import Any, Callable

# the ranks' MASTER_PORT; tests import it from here
from megatron_async.weight_transfer.group import free_port  # noqa: F401


PRELOAD = ["torch", "megatron_async.llm"]
"""Modules the fork server imports once, so that a rank starts in milliseconds instead of
importing torch (seconds on a small CPU). Nothing that reads the environment at import time
(Triton reads TRITON_INTERPRET) belongs here: a rank gets the caller's environment of the moment."""


def _context():
    """Ranks are forked from a server process that imported ``PRELOAD`` and nothing else (no
    CUDA context, no threads of the caller): as clean as a spawned process, without its imports."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _CallerFd:
    """The caller's file descriptor ``fd`` as it is at launch (pytest redirects stdout / stderr
    per test), handed to a rank: the fork server's own would be those of its start."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)  # pickled while the rank is launched


def _received_fd(dup) -> int:
    return dup.detach()


def _child(fn: Callable, rank: int, world_size: int, env: dict[str, str], args: tuple, results: mp.Queue,
           dump_at: float, streams: tuple[int, int]) -> None:
    for target, fd in zip((1, 2), streams):  # the caller's stdout / stderr, as a spawned process has them
        os.dup2(fd, target)
        os.close(fd)
    # A rank still running 2 s before the deadline (wall clock) prints every thread's Python
    # stack to stderr (pytest shows it), so a hang names where it waits (a collective, a sync).
    faulthandler.dump_traceback_later(max(0.5, dump_at - time.time()), exit=False)
    os.environ.clear()  # the caller's environment now, as a spawned process would have it
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS") and "torch" in sys.modules:  # torch was imported before this setting
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    try:
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # report everything, including a CommunicatorError the test expects
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 30.0,
              env: dict[str, str] | None = None) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank (a module-level function: it is pickled
    by name); returns the results by rank. Raises RuntimeError with the child's traceback
    if one raises (or exits without a result), and TimeoutError (after killing them all) if
    any is still running after ``timeout_s``."""
    ctx = _context()
    results = ctx.Queue()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", **(env or {})}
    dump_at = time.time() + max(1.0, timeout_s - 2.0)
    streams = (_CallerFd(1), _CallerFd(2))
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, env, args, results, dump_at, streams), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    dead_since: dict[int, float] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
                got[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):  # a rank that exited without a result (killed, os._exit)
                if r not in got and p.exitcode is not None:
                    # grace: a result it put is whole in the pipe once it exited (its queue's feeder thread is
                    # joined at exit), but may have landed after the last get: one more get finds it
                    if now - dead_since.setdefault(r, now) > 0.5:
                        got[r] = (False, f"exited with code {p.exitcode} without a result")
            if now > deadline:
                running = sorted(set(range(world_size)) - set(got))
                failed = "".join(f"\nrank {r} failed first:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok)
                raise TimeoutError(f"ranks {running} still running after {timeout_s} s (their Python stacks are "
                                   f"on stderr){failed}")
    finally:
        wait = 5.0 if len(got) == world_size else 0.1  # timed out or interrupted: kill at once
        for p in procs:
            p.join(timeout=wait)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    if failed:
        raise RuntimeError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(failed.items())))
    return [got[r][1] for r in range(world_size)]
