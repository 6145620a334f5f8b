"""The admin operations (admin_routes.py), run on the engine thread between two steps: each
takes the engine, the LLM's ``update_weights`` and the arguments admin_routes.py validated, and
its outcome is an HTTP status and a JSON body (the engine's state, or an OpenAI error object).
Plain names and arguments, so that a front-end process can ask for one (bridge.py)."""
from __future__ import annotations

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


WEIGHT_TRANSFER_METHODS = ("init_weight_transfer", "update_weights_from_distributed", "update_weights_from_ipc")
"""What a data-parallel coordinator's ``update_weights`` may name instead of a checkpoint path
(``{"method": NAME, "args": {...}}``), called on the engine (the refit path: docs/REFIT.md)."""


def run_engine_op(engine, op: str, args: dict, update_weights: Callable[..., int] | None = None,
                  weights_owner=None) -> tuple[int, dict]:
    """A coordinator's control operation (coordinator/controls.py) on this engine: the admin
    operations, ``set_generation_epoch`` ({"epoch": n}: the version stamped on every token from
    now on, ``engine.set_weight_version`` keeping the KV of running requests) and
    ``update_weights`` by a weight-transfer method of ``weights_owner`` (the engine)."""
    if op == "set_generation_epoch":
        epoch = args.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            return 400, resp.error_body(f"epoch must be an int >= 0, got {epoch!r}", 400)
        return run_guarded(engine, lambda: engine.set_weight_version(epoch, recompute_kv=False))
    if op == "update_weights" and "method" in args:
        method = getattr(weights_owner, str(args["method"]), None)
        if args["method"] not in WEIGHT_TRANSFER_METHODS or method is None:
            return 400, resp.error_body(f"no weight-transfer method {args['method']!r} here", 400)
        return run_guarded(engine, lambda: method(**dict(args.get("args") or {})))
    if op not in ADMIN_OPS:
        return 400, resp.error_body(f"unknown operation {op!r}", 400)
    return run_admin_op(engine, update_weights, op, args)


def run_guarded(engine, action: Callable[[], Any]) -> tuple[int, dict]:
    """``action()``'s outcome as (status, body): see ``run_admin_op``."""
    try:
        action()
        return 200, engine_status(engine)
    except (ValueError, TypeError) as e:
        return 400, resp.error_body(str(e), 400)
    except Exception as e:  # noqa: BLE001 -- reported to the caller, the loop keeps serving: never a 5xx
        if not isinstance(e, (RuntimeError, NotImplementedError)):
            log.exception("admin operation failed")
        return 409, resp.error_body(f"{type(e).__name__}: {e}", 409)
