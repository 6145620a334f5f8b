"""Admin routes for refit from a training job (only with ``--enable-admin-endpoints``), as SGLang
and vLLM expose them; the operations run on the engine thread between two steps, on every
tensor-parallel rank (``dp_engine/engine_ops.EVERY_RANK_OPS``: the follower ranks of a TP server run them too).

    POST /init_weight_transfer   {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1,
                                  "world_size": 3, "backend": "nccl" | "gloo" | null, "timeout_s": 300}
    POST /update_weights_from_distributed
                                 {"manifest": {...} | "<json>", "version": 3, "recompute_kv": true}
    POST /update_weights_from_ipc {"handles": {...} | [{...}, ...] | "<json>", "version": 3, "recompute_kv": true}
    POST /destroy_weight_transfer {}
    POST /abort_requests         {"request_ids": []}   (empty or absent: every unfinished request)

``init_weight_transfer`` returns once every rank of the group joined, ``update_weights_from_distributed``
once the trainer's broadcast ended (``megatron_async.weight_transfer.send`` on its side). A bad
manifest, or a body that is not JSON at all, is still refused inside the transfer's begin frame, so
the trainer's ``send`` fails instead of waiting. 400 for bad input, 409 for a state that refuses
(weights suspended, a transfer that failed), never a 5xx."""
from __future__ import annotations

import numbers
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from megatron_async.serve.admin_routes import _BadBody, _body, _json, add_admin_routes

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
    address, backend, timeout = obj.get("master_address"), obj.get("backend"), obj.get("timeout_s", 300.0)
    if not isinstance(address, str) or not address:
        raise _BadBody("master_address (the trainer's host) is required")
    port = _int(obj, "master_port", 1)
    if port > 65535:
        raise _BadBody(f"master_port must be <= 65535, got {port}")
    if backend not in (None, "gloo", "nccl"):
        raise _BadBody(f"backend must be 'nccl', 'gloo' or null, got {backend!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < 1e6:
        raise _BadBody(f"timeout_s must be a positive number of seconds, got {timeout!r}")
    return {"master_address": address, "master_port": port, "rank_offset": _int(obj, "rank_offset", 0),
            "world_size": _int(obj, "world_size", 1), "backend": backend, "timeout_s": float(timeout)}


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


VALIDATORS: dict[str, Callable[[dict], dict]] = {
    "init_weight_transfer": _init, "update_weights_from_ipc": _ipc, "destroy_weight_transfer": lambda obj: {},
    "abort_requests": _abort,
}
_VERSION_FIELDS = frozenset({"version", "recompute_kv"})
FIELDS: dict[str, frozenset[str]] = {
    "init_weight_transfer": frozenset({"master_address", "master_port", "rank_offset", "world_size", "backend",
                                       "timeout_s"}),
    "update_weights_from_ipc": frozenset({"handles"}) | _VERSION_FIELDS, "destroy_weight_transfer": frozenset(),
    "abort_requests": frozenset({"request_ids"}),
    "update_weights_from_distributed": frozenset({"manifest"}) | _VERSION_FIELDS,
}
"""Operation -> the fields its body may hold (any other: 400)."""


def add_refit_routes(app: FastAPI, engine_loop) -> None:
    """The routes above (``engine_loop``: as in ``admin_routes.add_admin_routes``)."""
    add_admin_routes(app, engine_loop, VALIDATORS, FIELDS)

    async def distributed(request: Request) -> Response:
        try:
            args = _distributed_args(await _body(request, FIELDS["update_weights_from_distributed"]))
        except _BadBody as e:  # still joins the transfer's begin frame, refusing (the trainer must not wait)
            args = {"metadata": None, "body_error": str(e)}
        status, body = await engine_loop.admin("update_weights_from_distributed", args)
        return _json(body, status)

    app.add_api_route("/update_weights_from_distributed", distributed, methods=["POST"])
