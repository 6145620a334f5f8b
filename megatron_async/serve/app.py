"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (SSE when
``stream``), /v1/models (the served model and its LoRA adapters), /health, /metrics, /tokenize,
/detokenize, and the admin endpoints when enabled (LoRA adapters' load and unload among them). Each endpoint family's module (completion_routes.py, chat_routes.py, tokenize_routes.py,
admin_routes.py) turns a body into engine choices (request_input.py, sampling_fields.py), hands
them to the engine thread (engine_loop.py) and answers from their events (responses.py); the
informational routes are here. Every error is OpenAI's JSON error object (400
bad input, 404 unknown model or route, 413 body too large, 415 not JSON, 503 the engine cannot
generate now (suspended, not paused), 500 unexpected), and a
client that goes away has its requests aborted."""
from __future__ import annotations

import logging

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException

from megatron_async.serve import openai_protocol as proto
from megatron_async.serve import responses as resp
from megatron_async.serve.admin_routes import add_admin_routes, add_lora_routes, add_refit_routes
from megatron_async.serve.chat_routes import chat_router
from megatron_async.serve.completion_routes import completions_router
from megatron_async.serve.http_guard import HttpGuard
from megatron_async.serve.metrics import CONTENT_TYPE
from megatron_async.serve.request_input import RequestInput
from megatron_async.serve.server_state import ServerState
from megatron_async.serve.tokenize_routes import tokenize_router

log = logging.getLogger("megatron_async.serve")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="megatron_async", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    app.add_middleware(HttpGuard, policy=state.policy, max_request_bytes=state.max_request_bytes)
    if state.policy.allowed_origins:  # outermost: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(state.policy.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"])
    if state.admin_endpoints:
        add_admin_routes(app, state.engine_loop, allowed_weights_dir=state.policy.allowed_weights_dir)
        add_refit_routes(app, state.engine_loop)
        add_lora_routes(app, state.engine_loop, allowed_weights_dir=state.policy.allowed_weights_dir)
    app.include_router(_info_router(state))
    inputs, text_of = RequestInput(state), resp.TokenText(state.tokenizer)
    app.include_router(completions_router(inputs, text_of))
    app.include_router(chat_router(inputs, text_of))
    app.include_router(tokenize_router(inputs))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(proto.BadRequest)
    async def _bad_request(_: Request, e: proto.BadRequest):
        return resp.error_response(str(e), e.status, e.param)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException):  # unknown route, wrong method
        return resp.error_response(str(e.detail), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return resp.error_response(str(e), 400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("request failed unexpectedly")
        return resp.error_response(f"internal error: {type(e).__name__}", 500)


def _info_router(state: ServerState) -> APIRouter:
    """/health, /v1/models, /metrics."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        return Response(status_code=200 if await state.engine_loop.healthy() else 503)

    @router.get("/v1/models")
    async def models():
        """The served model, then each LoRA adapter loaded now (``parent``: the served model, as vLLM lists them)."""
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "megatron_async",
                "max_model_len": state.max_model_len}
        adapters = [{**card, "id": name, "parent": state.model_name}
                    for name in await state.engine_loop.adapters() or ()]
        return {"object": "list", "data": [card, *adapters]}

    @router.get("/metrics")
    async def metrics():
        return Response(await state.engine_loop.metrics_text(), media_type=CONTENT_TYPE)

    return router
