"""Admin endpoints for an RL driver (only with ``--enable-admin-endpoints``): pause and resume
generation, update the weights from a checkpoint directory, suspend and resume device memory.

    POST /pause_generation   {"mode": "keep" | "wait" | "abort"}   (default "keep")
    POST /resume_generation  {}
    POST /update_weights     {"path": "/ckpt/dir", "version": 3}   (version optional)
    POST /suspend            {"tags": ["weights", "kv_cache"], "keep_weights_on_host": true}
    POST /resume             {"tags": ["weights", "kv_cache"]}

Each runs on the engine thread between two steps (``EngineLoop.call``) and answers JSON with
the engine's state; bad input is a 400, an operation the engine's state refuses (wrong order,
generation not paused) a 409, both as OpenAI error objects."""
from __future__ import annotations

import asyncio
import json
import logging
import numbers
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from megatron_async.inference.memory_suspend import TAGS
from megatron_async.serve import responses as resp

log = logging.getLogger("megatron_async.serve")


class _BadBody(ValueError):
    pass


def _json(body: dict, status: int = 200) -> Response:
    return Response(json.dumps(body), status_code=status, media_type="application/json")


def _status(engine) -> dict:
    return {"paused": engine.is_paused, "suspended": sorted(engine.memory.suspended),
            "weight_version": engine.weight_version}


def add_admin_routes(app: FastAPI, engine_loop, update_weights: Callable[..., int]) -> None:
    """``update_weights``: the LLM's (path, version) -> new version."""
    engine = engine_loop.engine

    async def run(job: Callable[[], Any]) -> Response:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_engine_thread() -> None:
            try:
                job()
                result, error = _status(engine), None
            except Exception as e:  # noqa: BLE001 -- reported to the caller, the loop keeps serving
                result, error = None, e

            def deliver() -> None:
                if not done.done():
                    done.set_exception(error) if error is not None else done.set_result(result)

            loop.call_soon_threadsafe(deliver)

        engine_loop.call(on_engine_thread)
        try:
            return _json(await done)
        except (ValueError, TypeError) as e:  # bad input (WeightUpdateError is a ValueError)
            return _json(resp.error_body(str(e), 400), 400)
        except Exception as e:  # noqa: BLE001 -- refused in this state (wrong order, not paused): never a 5xx
            if not isinstance(e, (RuntimeError, NotImplementedError)):
                log.exception("admin operation failed")
            return _json(resp.error_body(f"{type(e).__name__}: {e}", 409), 409)

    async def body(request: Request) -> dict:
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

    def tags_of(obj: dict) -> tuple[str, ...]:
        tags = obj.get("tags", list(TAGS))
        if isinstance(tags, str):
            tags = [tags]
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise _BadBody(f"tags must be a list of strings among {list(TAGS)}")
        return tuple(tags)

    def route(path: str, make_job: Callable[[dict], Callable[[], Any]]) -> None:
        async def handler(request: Request) -> Response:
            try:
                job = make_job(await body(request))
            except _BadBody as e:
                return _json(resp.error_body(str(e), 400), 400)
            return await run(job)

        app.add_api_route(path, handler, methods=["POST"])

    def pause(obj: dict):
        mode = obj.get("mode", "keep")
        if not isinstance(mode, str):
            raise _BadBody("mode must be 'keep', 'wait' or 'abort'")
        return lambda: engine.pause_generation(mode)

    def update(obj: dict):
        path, version = obj.get("path"), obj.get("version")
        if not isinstance(path, str) or not path:
            raise _BadBody("path (a checkpoint directory) is required")
        if version is not None and (isinstance(version, bool) or not isinstance(version, numbers.Integral)):
            raise _BadBody(f"version must be an integer or null, got {version!r}")
        return lambda: update_weights(path, version=version)

    def suspend(obj: dict):
        tags, keep = tags_of(obj), obj.get("keep_weights_on_host", True)
        if not isinstance(keep, bool):
            raise _BadBody("keep_weights_on_host must be true or false")
        return lambda: engine.suspend(tags, keep_weights_on_host=keep)

    def resume(obj: dict):
        tags = tags_of(obj)
        return lambda: engine.resume(tags)

    route("/pause_generation", pause)
    route("/resume_generation", lambda obj: engine.resume_generation)
    route("/update_weights", update)
    route("/suspend", suspend)
    route("/resume", resume)
