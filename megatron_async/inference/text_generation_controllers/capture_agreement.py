"""Graph captures of ranks that share steps (TP ranks, data-parallel engines under expert
parallelism) without their eager runs, a failed one retried by every rank together.

Every rank captures its plan at once; its graphs hold the TP all-reduces or the EP exchange. After
a whole dry pass (every kernel built and loaded) a graph captures without running its step
first, as on one GPU. A capture that fails so must be captured again after one eager run, and
that run's collectives need every rank: a rank retrying alone would wait for peers that never
come. So no rank retries alone. Each rank captures its whole list, noting the keys whose capture
failed (nothing inside a capture executes, so meanwhile no rank waits on another); then the
ranks take the element-wise max of those notes in one host-side round over the engines'
communicator (``ZMQCommunicator.all_reduce_max``, the ``agree`` callable), and every rank drops
each key that any rank failed and captures it again after an eager run, key by key, agreeing
after each whether every rank succeeded: a rank that cannot capture even after an eager run ends
the warm-up on every rank with an error, not in a hang."""
from __future__ import annotations

from collections.abc import Callable

Agree = Callable[[list[int]], list[int]]
"""The element-wise max of a list of ints over the ranks (every rank calls it at once)."""


class GraphCaptureFailed(RuntimeError):
    """A capture without an eager run of its step failed and was not retried on this rank alone
    (``CudaGraphRunner._capture(alone=False)``); the capture's state is already undone."""

    def __init__(self, key, cause: Exception):
        super().__init__(f"CUDA graph {key} failed to capture without an eager run first ({cause})")
        self.key = key


def capture_together(graphs, keys: list, runs_first: Callable[[], bool], agree: Agree) -> list:
    """Capture ``keys`` on ``graphs`` (the ``CudaGraphRunner`` of ranks sharing steps) on every rank at once,
    each with an eager run first when ``runs_first()`` says so; returns the keys captured again
    after an eager run (the same list on every rank)."""
    failed = set()
    for key in keys:
        if key in graphs.graphs:  # a sampling tail's forward, captured with an earlier tail
            continue
        try:
            graphs.graphs[key] = graphs._capture(key, eager_run=runs_first(), alone=False)
        except GraphCaptureFailed:
            failed.add(key)
    anyone = agree([int(key in failed) for key in keys]) if keys else []
    retried = [key for key, flag in zip(keys, anyone) if flag]
    for key in retried:
        _capture_again(graphs, key, agree)
    return retried


def _capture_again(graphs, key, agree: Agree) -> None:
    """Every rank: drop ``key``'s graph (a rank whose capture succeeded holds one) and, for a
    sampling tail, its forward's (the failed capture may have been the forward's, and a rank
    holding it would skip the forward's eager run that the others make), run the step eagerly
    (collectives with every rank) and capture it."""
    forward = graphs.forward_key(key)
    for k in (key, forward):
        if k is not None:
            graphs.drop(k)
    error = None
    try:
        graphs.graphs[key] = graphs._capture(key, eager_run=True)
    except Exception as e:  # noqa: BLE001 -- told to every rank first, raised below
        error = e
    if agree([int(error is not None)])[0]:
        if error is not None:
            raise error
        raise RuntimeError(f"CUDA graph {key}: another rank failed to capture it even after an eager run; "
                           "the warm-up stops on every rank")
    graphs.capture_retries += 1
    for k in (key, forward):  # tails captured earlier read the forward captured now (the same logits buffer)
        if k is not None and k.logits_only:
            for step in graphs.graphs.values():
                if getattr(step, "forward", None) is not None and step.forward.key == k:
                    step.forward = graphs.graphs[k]
