"""Admin endpoints for an RL driver (only with ``--enable-admin-endpoints``): pause and resume
generation, update the weights from a checkpoint directory, suspend and resume device memory, and
refit from a training job as SGLang and vLLM expose it.

    POST /pause_generation   {"mode": "keep" | "wait" | "abort"}   (default "keep")
    POST /resume_generation  {}
    POST /update_weights     {"path": "/ckpt/dir", "version": 3}   (version optional)
    POST /suspend            {"tags": ["weights", "kv_cache"], "keep_weights_on_host": true}
    POST /resume             {"tags": ["weights", "kv_cache"]}
    POST /init_weight_transfer   {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1,
                                  "world_size": 3, "backend": "nccl" | "gloo" | null, "timeout_s": 30}
    POST /update_weights_from_distributed
                                 {"manifest": {...} | "<json>", "version": 3, "recompute_kv": true}
    POST /update_weights_from_ipc {"handles": {...} | [{...}, ...] | "<json>", "version": 3, "recompute_kv": true}
    POST /destroy_weight_transfer {}
    POST /abort_requests         {"request_ids": []}   (empty or absent: every unfinished request)
    POST /v1/load_lora_adapter   {"lora_name": "sql", "lora_path": "/adapters/sql"}   (docs/LORA.md)
    POST /v1/unload_lora_adapter {"lora_name": "sql"}   (unknown: 404; in use by a request: 409)
    POST /update_lora_from_distributed {"lora_name": "sql", "manifest": {...}}   (an adapter's refit)
    POST /update_lora_from_ipc   {"lora_name": "sql", "handles": {...} | [{...}, ...] | "<json>"}

Behind a coordinator (``serve --engine``) the weight-update, transfer and adapter routes also take
``"engines": [0, 2]``, the indexes of the engines to run on (default every one; e.g. each engine's
``init_weight_transfer`` with its own ``rank_offset``); a server with its own engine refuses it (400).

The body is checked here (in whichever process serves HTTP) as strictly as the OpenAI routes'
(the size, timeout and key checks of http_guard.py, then: a JSON media type when the body is not
empty, else 415; JSON that Python can hold; only the route's own fields); a path is a directory
under ``--allowed-weights-dir`` (outside it: 403), an adapter's ``lora_path`` too. The operation runs on the engine thread between
two steps (dp_engine/engine_ops.py) and answers JSON with the engine's state; bad input is a 400, an
operation the engine's state refuses (wrong order, generation not paused) a 409, both as OpenAI
error objects, never a 5xx. The refit operations run on every tensor-parallel rank
(``dp_engine/engine_ops.EVERY_RANK_OPS``: the follower ranks of a TP server run them too).
``init_weight_transfer`` returns once every rank of the group joined, ``update_weights_from_distributed``
once the trainer's broadcast ended (``megatron_async.weight_transfer.send`` on its side); both wait
off the engine's step loop, up to ``timeout_s`` (default: ``InferenceConfig.weight_transfer_timeout_s``),
and a wait that ran out is a 409 naming the address, the port and the timeout. A bad
manifest, or a body that is not JSON at all, is still refused inside the transfer's begin frame, so
the trainer's ``send`` fails instead of waiting. 400 for bad input, 409 for a state that refuses
(weights suspended, a transfer that failed), never a 5xx."""
from __future__ import annotations

import json
import numbers
import os
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from megatron_async.dp_engine.engine_ops import error_body
from megatron_async.serve.request_input import check_content_type, decode_json
from megatron_async.serve.openai_protocol import BadRequest


class _BadBody(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _json(body: dict, status: int = 200) -> Response:
    return Response(json.dumps(body), status_code=status, media_type="application/json")


def _refused(e: _BadBody) -> Response:
    return _json(error_body(str(e), e.status), e.status)


async def _body(request: Request, fields: frozenset[str]) -> dict:
    """The body as a JSON object holding only ``fields`` (an empty body: {})."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        check_content_type(request.headers.get("content-type"))
        obj = decode_json(raw)
    except BadRequest as e:
        raise _BadBody(str(e), e.status) from None
    if not isinstance(obj, dict):
        raise _BadBody("the body must be a JSON object")
    unknown = sorted(k[:40] for k in obj if k not in fields)
    if unknown:
        raise _BadBody(f"unknown field(s) {unknown[:5]}: this route takes {sorted(fields) or 'no field'}")
    return obj


def weights_path(path: str, allowed: str | None) -> str:
    """``path`` resolved (``..`` and symlinks followed): 403 outside ``allowed`` (itself resolved),
    400 when it is not a directory or cannot be a path at all."""
    try:
        real = os.path.realpath(path)
        is_dir = os.path.isdir(real)
    except (OSError, ValueError) as e:  # ValueError: a NUL in it
        raise _BadBody(f"path is not a usable path: {e}") from None
    if allowed is not None and os.path.commonpath([real, allowed]) != allowed:
        raise _BadBody("path resolves outside --allowed-weights-dir", 403)
    if not is_dir:
        raise _BadBody(f"path {path[:200]!r} is not a checkpoint directory")
    return real


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
    return {"path": path, "version": None if version is None else int(version)}  # the path: checked by the route


def _suspend(obj: dict) -> dict:
    keep = obj.get("keep_weights_on_host", True)
    if not isinstance(keep, bool):
        raise _BadBody("keep_weights_on_host must be true or false")
    return {**_tags(obj), "keep_weights_on_host": keep}


def _engines(obj: dict, args: dict) -> dict:
    """``args`` with ``engines`` (behind a coordinator: the indexes of the engines to run on;
    default every one). The engine side of a server with its own engine refuses it (engine_ops.py)."""
    if "engines" in obj:
        engines = obj["engines"]
        if not isinstance(engines, list) or not engines or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in engines):
            raise _BadBody("engines must be a non-empty list of engine indexes")
        args["engines"] = engines
    return args


def _on_engines(validate: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """``validate`` taking ``engines`` too (the operations a coordinator runs on some engines)."""
    return lambda obj: _engines(obj, validate(obj))


_ENGINES = frozenset({"engines"})
VALIDATORS: dict[str, Callable[[dict], dict]] = {
    "pause_generation": _pause, "resume_generation": lambda obj: {}, "update_weights": _on_engines(_update),
    "suspend": _suspend, "resume": _tags,
}
"""Operation (dp_engine/engine_ops.py) -> its body checked into the arguments it runs with (_BadBody: a 4xx)."""
FIELDS: dict[str, frozenset[str]] = {
    "pause_generation": frozenset({"mode"}), "resume_generation": frozenset(),
    "update_weights": frozenset({"path", "version"}) | _ENGINES, "suspend": frozenset({"tags", "keep_weights_on_host"}),
    "resume": frozenset({"tags"}),
}
"""Operation -> the fields its body may hold (any other: 400)."""


PATH_ARGS = ("path", "lora_path")
"""Arguments that name a directory to load from (checked by ``weights_path``)."""


def add_admin_routes(app: FastAPI, engine_loop, validators: dict[str, Callable[[dict], dict]] | None = None,
                     fields: dict[str, frozenset[str]] | None = None, allowed_weights_dir: str | None = None,
                     prefix: str = "/") -> None:
    """``engine_loop``: an EngineLoop, or a front-end's stand-in for it (frontend.py); its
    ``admin(op, args)`` runs the operation on the engine thread and returns (status, body).
    ``validators`` / ``fields``: the routes to add and the fields each body may hold (default
    ``VALIDATORS`` / ``FIELDS``; ``add_refit_routes`` and ``add_lora_routes`` add their own).
    ``allowed_weights_dir``: a ``path`` or ``lora_path`` argument must resolve under it (None:
    anywhere). ``prefix``: the routes are ``{prefix}{op}``."""
    fields = FIELDS if fields is None else fields

    def route(op: str, validate: Callable[[dict], dict]) -> None:
        async def handler(request: Request) -> Response:
            try:
                args = validate(await _body(request, fields[op]))
                for key in PATH_ARGS:
                    if key in args:
                        args[key] = weights_path(args[key], allowed_weights_dir)
            except _BadBody as e:
                return _refused(e)
            status, body = await engine_loop.admin(op, args)
            return _json(body, status)

        app.add_api_route(f"{prefix}{op}", handler, methods=["POST"])

    for op, validate in (VALIDATORS if validators is None else validators).items():
        route(op, validate)


# ---------------------------------------------------------------- refit from a training job
def _int(obj: dict, key: str, low: int, default: Any = ...) -> Any:
    value = obj.get(key, default)
    if value is ...:
        raise _BadBody(f"{key} is required")
    if value is not default and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low):
        raise _BadBody(f"{key} must be an integer >= {low}, got {value!r}")
    return value


def _version_args(obj: dict) -> dict:
    version, recompute = obj.get("version"), obj.get("recompute_kv", True)
    if version is not None:
        version = _int(obj, "version", 0)
    if not isinstance(recompute, bool):
        raise _BadBody("recompute_kv must be true or false")
    return {"version": version, "recompute_kv": recompute}


def _init(obj: dict) -> dict:
    address, backend, timeout = obj.get("master_address"), obj.get("backend"), obj.get("timeout_s")
    if not isinstance(address, str) or not address:
        raise _BadBody("master_address (the trainer's host) is required")
    port = _int(obj, "master_port", 1)
    if port > 65535:
        raise _BadBody(f"master_port must be <= 65535, got {port}")
    if backend not in (None, "gloo", "nccl"):
        raise _BadBody(f"backend must be 'nccl', 'gloo' or null, got {backend!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                or not 0 < timeout < 1e6):
        raise _BadBody(f"timeout_s must be a positive number of seconds, got {timeout!r}")
    return {"master_address": address, "master_port": port, "rank_offset": _int(obj, "rank_offset", 0),
            "world_size": _int(obj, "world_size", 1), "backend": backend,
            "timeout_s": None if timeout is None else float(timeout)}


def _ipc(obj: dict) -> dict:
    handles = obj.get("handles")
    if not isinstance(handles, (dict, list, str)) or not handles:
        raise _BadBody("handles (one payload of weight_transfer.ipc.share, or a list of them) is required")
    return {"handles": handles, **_version_args(obj)}


def _abort(obj: dict) -> dict:
    ids = obj.get("request_ids", [])
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _BadBody("request_ids must be a list of request ids (empty: every unfinished request)")
    return {"request_ids": ids}


def _distributed_args(obj: dict) -> dict:
    if "manifest" not in obj:
        raise _BadBody("manifest (weight_transfer.build_manifest's JSON) is required")
    return {"metadata": obj["manifest"], **_version_args(obj)}


def _lora_distributed_args(obj: dict) -> dict:
    if "manifest" not in obj:
        raise _BadBody("manifest (weight_transfer.build_manifest's JSON of the adapter's tensors) is required")
    return {"lora_name": _lora_name(obj), "metadata": obj["manifest"]}


def _lora_ipc(obj: dict) -> dict:
    handles = obj.get("handles")
    if not isinstance(handles, (dict, list, str)) or not handles:
        raise _BadBody("handles (one payload of weight_transfer.ipc.share, or a list of them) is required")
    return {"lora_name": _lora_name(obj), "handles": handles}


REFIT_VALIDATORS: dict[str, Callable[[dict], dict]] = {
    "init_weight_transfer": _on_engines(_init), "update_weights_from_ipc": _on_engines(_ipc),
    "destroy_weight_transfer": _on_engines(lambda obj: {}), "abort_requests": _abort,
    "update_lora_from_ipc": _on_engines(_lora_ipc),
}
_VERSION_FIELDS = frozenset({"version", "recompute_kv"})
REFIT_FIELDS: dict[str, frozenset[str]] = {
    "init_weight_transfer": frozenset({"master_address", "master_port", "rank_offset", "world_size", "backend",
                                       "timeout_s"}) | _ENGINES,
    "update_weights_from_ipc": frozenset({"handles"}) | _VERSION_FIELDS | _ENGINES,
    "destroy_weight_transfer": _ENGINES, "abort_requests": frozenset({"request_ids"}),
    "update_weights_from_distributed": frozenset({"manifest"}) | _VERSION_FIELDS | _ENGINES,
    "update_lora_from_distributed": frozenset({"lora_name", "manifest"}) | _ENGINES,
    "update_lora_from_ipc": frozenset({"lora_name", "handles"}) | _ENGINES,
}
"""Operation -> the fields its body may hold (any other: 400)."""


def add_refit_routes(app: FastAPI, engine_loop) -> None:
    """The refit routes (``engine_loop``: as in ``add_admin_routes``)."""
    add_admin_routes(app, engine_loop, REFIT_VALIDATORS, REFIT_FIELDS)

    def distributed(op: str, read: Callable[[dict], dict]):
        async def handler(request: Request) -> Response:
            try:
                args = read(await _body(request, REFIT_FIELDS[op]))
            except _BadBody as e:  # still joins the transfer's begin frame, refusing (the trainer must not wait)
                args = {"metadata": None, "body_error": str(e)}
            status, body = await engine_loop.admin(op, args)
            return _json(body, status)

        app.add_api_route(f"/{op}", handler, methods=["POST"])

    distributed("update_weights_from_distributed", _on_engines(_distributed_args))
    distributed("update_lora_from_distributed", _on_engines(_lora_distributed_args))  # an adapter's (docs/LORA.md)


# ---------------------------------------------------------------- LoRA adapters (vLLM's routes)
def _lora_name(obj: dict) -> str:
    name = obj.get("lora_name")
    if not isinstance(name, str) or not name:
        raise _BadBody("lora_name (the adapter's name, a request's model) is required")
    return name


def _load_lora(obj: dict) -> dict:
    path = obj.get("lora_path")
    if not isinstance(path, str) or not path:
        raise _BadBody("lora_path (a PEFT adapter directory) is required")
    return {"lora_name": _lora_name(obj), "lora_path": path}  # the path: checked by the route


LORA_VALIDATORS: dict[str, Callable[[dict], dict]] = {
    "load_lora_adapter": _on_engines(_load_lora),
    "unload_lora_adapter": _on_engines(lambda obj: {"lora_name": _lora_name(obj)}),
}
LORA_FIELDS: dict[str, frozenset[str]] = {
    "load_lora_adapter": frozenset({"lora_name", "lora_path"}) | _ENGINES,
    "unload_lora_adapter": frozenset({"lora_name"}) | _ENGINES,
}
"""Operation -> the fields its body may hold (any other: 400)."""


def add_lora_routes(app: FastAPI, engine_loop, allowed_weights_dir: str | None = None) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (``engine_loop``: as in ``add_admin_routes``)."""
    add_admin_routes(app, engine_loop, LORA_VALIDATORS, LORA_FIELDS, allowed_weights_dir, prefix="/v1/")
