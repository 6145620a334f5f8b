"""Admin endpoints for an RL driver (only with ``--enable-admin-endpoints``): pause and resume
generation, update the weights from a checkpoint directory, suspend and resume device memory.

    POST /pause_generation   {"mode": "keep" | "wait" | "abort"}   (default "keep")
    POST /resume_generation  {}
    POST /update_weights     {"path": "/ckpt/dir", "version": 3}   (version optional)
    POST /suspend            {"tags": ["weights", "kv_cache"], "keep_weights_on_host": true}
    POST /resume             {"tags": ["weights", "kv_cache"]}

The body is checked here (in whichever process serves HTTP); the operation runs on the engine
thread between two steps (admin_ops.py) and answers JSON with the engine's state; bad input is a
400, an operation the engine's state refuses (wrong order, generation not paused) a 409, both as
OpenAI error objects."""
from __future__ import annotations

import json
import numbers
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from megatron_async.serve import responses as resp


class _BadBody(ValueError):
    pass


def _json(body: dict, status: int = 200) -> Response:
    return Response(json.dumps(body), status_code=status, media_type="application/json")


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise _BadBody(f"the body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _BadBody("the body must be a JSON object")
    return obj


def _tags(obj: dict) -> dict:
    """{"tags": a tuple of strings} (the engine checks the names), or {} for the engine's default."""
    if "tags" not in obj:
        return {}
    tags = obj["tags"]
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise _BadBody("tags must be a list of strings (weights, kv_cache)")
    return {"tags": tuple(tags)}


def _pause(obj: dict) -> dict:
    mode = obj.get("mode", "keep")
    if not isinstance(mode, str):
        raise _BadBody("mode must be 'keep', 'wait' or 'abort'")
    return {"mode": mode}


def _update(obj: dict) -> dict:
    path, version = obj.get("path"), obj.get("version")
    if not isinstance(path, str) or not path:
        raise _BadBody("path (a checkpoint directory) is required")
    if version is not None and (isinstance(version, bool) or not isinstance(version, numbers.Integral)):
        raise _BadBody(f"version must be an integer or null, got {version!r}")
    return {"path": path, "version": None if version is None else int(version)}


def _suspend(obj: dict) -> dict:
    keep = obj.get("keep_weights_on_host", True)
    if not isinstance(keep, bool):
        raise _BadBody("keep_weights_on_host must be true or false")
    return {**_tags(obj), "keep_weights_on_host": keep}


VALIDATORS: dict[str, Callable[[dict], dict]] = {
    "pause_generation": _pause, "resume_generation": lambda obj: {}, "update_weights": _update,
    "suspend": _suspend, "resume": _tags,
}
"""Operation (admin_ops.py) -> its body checked into the arguments it runs with (_BadBody: a 400)."""


def add_admin_routes(app: FastAPI, engine_loop, validators: dict[str, Callable[[dict], dict]] | None = None) -> None:
    """``engine_loop``: an EngineLoop, or a front-end's stand-in for it (frontend.py); its
    ``admin(op, args)`` runs the operation on the engine thread and returns (status, body).
    ``validators``: the routes to add (default ``VALIDATORS``; refit_routes.py adds its own)."""

    def route(op: str, validate: Callable[[dict], dict]) -> None:
        async def handler(request: Request) -> Response:
            try:
                args = validate(await _body(request))
            except _BadBody as e:
                return _json(resp.error_body(str(e), 400), 400)
            status, body = await engine_loop.admin(op, args)
            return _json(body, status)

        app.add_api_route(f"/{op}", handler, methods=["POST"])

    for op, validate in (VALIDATORS if validators is None else validators).items():
        route(op, validate)
