"""The admin operations (admin_routes.py), run on the engine thread between two steps: each
takes the engine, the LLM's ``update_weights`` and the arguments admin_routes.py validated, and
its outcome is an HTTP status and a JSON body (the engine's state, or an OpenAI error object).
Plain names and arguments, so that a front-end process can ask for one (bridge.py)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from megatron_async.serve import responses as resp
from megatron_async.serve.refit_ops import REFIT_OPS

log = logging.getLogger("megatron_async.serve")


ADMIN_OPS: dict[str, Callable[[Any, Callable[..., int] | None, dict], Any]] = {
    "pause_generation": lambda engine, _, args: engine.pause_generation(**args),
    "resume_generation": lambda engine, _, args: engine.resume_generation(),
    "update_weights": lambda _, update_weights, args: update_weights(args["path"], version=args.get("version")),
    "suspend": lambda engine, _, args: engine.suspend(**args),
    "resume": lambda engine, _, args: engine.resume(**args),
    "set_generation_epoch": lambda engine, _, args: _set_generation_epoch(engine, args),
    **REFIT_OPS,
}
"""Operation name (also its route: POST /NAME) -> what it runs. admin_routes.py's checks give
the engine methods' keyword arguments (a missing one: the engine's default)."""


def engine_status(engine) -> dict:
    return {"paused": engine.is_paused, "suspended": sorted(engine.memory.suspended),
            "weight_version": engine.weight_version}


def run_admin_op(engine, update_weights: Callable[..., int] | None, op: str, args: dict) -> tuple[int, dict]:
    """(200, the engine's state) once ``op`` ran; 400 for bad input (WeightUpdateError is a
    ValueError), 409 for an operation the engine's state refuses (wrong order, not paused)."""
    return run_guarded(engine, lambda: ADMIN_OPS[op](engine, update_weights, args))


def run_engine_op(engine, op: str, args: dict, update_weights: Callable[..., int] | None = None) -> tuple[int, dict]:
    """A data-parallel coordinator's control operation (coordinator/controls.py) on this engine:
    the admin operations (the refit ones included), and ``stats`` (its ``EngineStats`` counters)."""
    if op == "stats":
        return 200, engine_counters(engine)
    if op not in ADMIN_OPS:
        return 400, resp.error_body(f"unknown operation {op!r}", 400)
    return run_admin_op(engine, update_weights, op, args)


def _set_generation_epoch(engine, args: dict) -> None:
    """The version stamped on every token from now on (the KV of running requests is kept)."""
    epoch = args.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
    engine.set_weight_version(epoch, recompute_kv=False)


def engine_counters(engine) -> dict:
    """The engine's ``EngineStats`` counters (its scalar fields) as plain values."""
    stats = engine.stats
    return {f.name: v for f in dataclasses.fields(stats)
            if isinstance(v := getattr(stats, f.name), (int, float)) and not isinstance(v, bool)}


def run_guarded(engine, action: Callable[[], Any]) -> tuple[int, dict]:
    """``action()``'s outcome as (status, body): see ``run_admin_op``."""
    try:
        action()
        return 200, engine_status(engine)
    except (ValueError, TypeError, OSError) as e:  # OSError: a checkpoint path that cannot be read
        return 400, resp.error_body(str(e), 400)
    except Exception as e:  # noqa: BLE001 -- reported to the caller, the loop keeps serving: never a 5xx
        if not isinstance(e, (RuntimeError, NotImplementedError)):
            log.exception("admin operation failed")
        return 409, resp.error_body(f"{type(e).__name__}: {e}", 409)
