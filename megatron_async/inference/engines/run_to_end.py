"""Stepping an engine until requests end: the loops of a caller without a driver of its own
(``LLM.generate`` runs ``run_requests``; ``run_until_done`` steps until nothing is unfinished).
They read what the engine reports and keep what belongs to other requests for its next
``step()``."""
from __future__ import annotations

from collections.abc import Callable

from megatron_async.inference.engines.step_result import StepResult
from megatron_async.inference.request import RequestOutput


def run_until_done(engine) -> list[RequestOutput]:
    """Every output until the engine (``DynamicInferenceEngine``) has no unfinished request."""
    outs = []
    while engine.has_unfinished_requests():
        res = engine.step()
        _check_not_stuck(engine, res)
        outs.extend(res.finished)
    return outs


def run_requests(engine, request_ids: list[int],
                 feed: Callable[[], tuple[list[int], bool]] | None = None) -> dict[int, RequestOutput]:
    """Step until these requests finish and return their outputs. Outputs and updates of
    other requests produced meanwhile are not lost: the engine's next ``step()`` returns them.
    ``feed`` (single-rank engines): called before every step, it adds requests and returns
    (their ids, whether it holds more); their outputs are returned too."""
    if engine.is_paused and request_ids:  # (the same answer on every rank: applied at one exchange)
        raise RuntimeError("generation is paused: new requests cannot run until resume_generation()")
    own, want, got = set(request_ids), set(request_ids), {}
    engine._quiet |= own  # their updates would be dropped below: do not build them
    more = feed is not None
    try:
        while True:
            if more:
                new, more = feed()
                own.update(new)
                want.update(new)
                engine._quiet.update(new)
            if not engine.ranks.still_waiting(want):
                if more:
                    continue
                break
            res = engine.step()
            _check_not_stuck(engine, res)
            for o in res.finished:
                if o.request_id in own:
                    got[o.request_id] = o
                    want.discard(o.request_id)
                else:
                    engine._held.finished.append(o)
            engine._held.updates.extend(u for u in res.updates if u.request_id not in own)
    finally:
        engine._quiet -= own
    engine.ranks.leader_waiting = False
    return got


def _check_not_stuck(engine, res: StepResult) -> None:
    """A loop stepping until requests finish would wait forever on a paused engine."""
    if engine.is_paused and res.step_id == -1 and not res.finished and not res.updates:
        raise RuntimeError("generation is paused and nothing can run: resume_generation() first")
