"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (SSE when
``stream``), /v1/models, /health, /metrics. Handlers turn a body into engine choices, hand them to
the engine thread (engine_loop.py) and read their events back. Every error is OpenAI's JSON error
object (400 bad input, 404 unknown model, 413 body too large, 415 not JSON), and a client that
goes away has its requests aborted. Work that grows with the input (decoding a big body, rendering
the chat template, tokenizing) runs on a thread pool, off the event loop, so that a huge prompt
delays no other request; a text prompt longer than any ``max_model_len`` tokens can hold is
refused before it is tokenized."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from megatron_async.inference.request import InvalidRequestError, RequestOutput, RequestUpdate
from megatron_async.models.chat_template import ChatTemplate, ChatTemplateError
from megatron_async.serve import echo
from megatron_async.serve import openai_protocol as proto
from megatron_async.serve import request_body
from megatron_async.serve import responses as resp
from megatron_async.serve import tool_calls
from megatron_async.serve.admin_routes import add_admin_routes
from megatron_async.serve.chat_output import ChatOutputFormat, chunk_choices
from megatron_async.serve.engine_loop import Choice, EngineLoop, Submission, merge_events
from megatron_async.serve.metrics import CONTENT_TYPE
from megatron_async.serve.sse_response import SSEResponse, client_disconnect

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
OFF_LOOP_BYTES = 64 * 2**10
"""Bodies, prompts and chat messages over this size are decoded, rendered and tokenized on the
thread pool; smaller ones inline (a thread hop costs more than their work)."""
MAX_COMPOSED_CHARS = 4
"""A tokenizer's normalizer (NFC / NFKC) may compose up to 3 characters into one before tokenizing."""
log = logging.getLogger("megatron_async.serve")


@dataclass
class ServerState:
    engine_loop: EngineLoop
    """The engine thread (engine_loop.py), or in a front-end process its stand-in (frontend.py)."""
    model_name: str
    tokenizer: object | None
    chat_template: ChatTemplate | None
    max_model_len: int
    """Most tokens (prompt + output) a request can reach: max_sequence_length capped by the KV pool."""
    max_requests: int
    """Requests the engine runs at once: the most choices (``n``) one request may ask for."""
    max_request_bytes: int
    """Largest body taken (413 beyond it)."""
    created: int = field(default_factory=lambda: int(time.time()))
    """Server start (Unix seconds): /v1/models' ``created``."""
    tool_call_parser: str | None = None
    """Parses tool calls out of chat answers to requests with tools (None: they stay text)."""
    reasoning_parser: str | None = None
    """Splits chat answers' reasoning sections into ``reasoning_content`` (None: left in content)."""
    admin_endpoints: bool = False
    """Serve the admin endpoints (admin_routes.py); off: 404."""


def max_token_chars(tokenizer) -> int:
    """The longest text one token of the vocabulary decodes to, in characters."""
    return max((len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size)), default=1)


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """More characters than this cannot tokenize into ``max_model_len`` tokens or fewer."""
    return max_model_len * max(1, max_token_chars(tokenizer)) * MAX_COMPOSED_CHARS


class _ClientGone(Exception):
    pass


def _error(message: str, status: int = 400, param: str | None = None) -> Response:
    # ASCII JSON: a message quoting the request (a lone surrogate included) always encodes
    return Response(json.dumps(resp.error_body(message, status, param)), status_code=status,
                    media_type="application/json")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="megatron_async", docs_url=None, redoc_url=None)
    text_of = resp.TokenText(state.tokenizer)
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="megatron-async-input")
    prompt_chars = max_prompt_chars(state.tokenizer, state.max_model_len) if state.tokenizer is not None else 0

    @app.exception_handler(proto.BadRequest)
    async def _bad_request(_: Request, e: proto.BadRequest):
        return _error(str(e), e.status, e.param)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException):  # unknown route, wrong method
        return _error(str(e.detail), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return _error(str(e), 400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("request failed unexpectedly")
        return _error(f"internal error: {type(e).__name__}", 500)

    if state.admin_endpoints:
        add_admin_routes(app, state.engine_loop)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if await state.engine_loop.healthy() else 503)

    @app.get("/v1/models")
    async def models():
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "megatron_async",
                "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return Response(await state.engine_loop.metrics_text(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, proto.CompletionRequest)
        _check_model(req.model)
        _check_n(req.n)
        proto.check_completion_options(req)
        echo.check_echo_options(req)
        raw_prompts = proto.completion_prompts(req)
        prompts = await _tokens(raw_prompts)
        echoed = echo.prompt_texts(raw_prompts, prompts, state.tokenizer) if req.echo else None
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        choices = [Choice(p, echo.with_prompt_scoring(req, _params(req, max_tokens, req.logprobs, i)))
                   for p in prompts for i in range(req.n)]
        head = resp.ResponseHead("text_completion", state.model_name, resp.new_id("cmpl"))

        text_offsets = [0] * len(choices)  # per choice: text of the tokens streamed so far
        scored = echo.wants_prompt_scores(req)
        ids = resp.TOKENS_SLOT if req.return_token_ids else None
        templates = [resp.chunk_template(head.body([resp.completion_chunk_choice(i, resp.TEXT_SLOT, None, ids)]))
                     for i in range(len(choices))] if req.stream else []

        def chunk(i: int, text: str, finish: str | None, tokens: list[int] | None, first: bool,
                  upd: RequestUpdate | None = None) -> dict | str:
            lp = prompt_lp = None
            if first and echoed is not None:
                text = echoed[i // req.n] + text
            if scored and upd is not None:  # prompt log-probs in the chunk after the prefill (serve/echo.py)
                lp, prompt_lp = echo.stream_logprobs(req, choices[i].prompt_tokens, upd, text_of, text_offsets[i])
            elif upd is not None and upd.new_tokens and upd.new_log_probs is not None:
                lp = resp.completion_logprobs(upd.new_tokens, upd.new_log_probs, upd.new_top_n_logprobs, text_of,
                                              text_offsets[i])
            if lp is not None:
                text_offsets[i] += sum(len(t) for t in lp["tokens"])
            if lp is None and prompt_lp is None and finish is None:  # the common chunk: only its text (and ids)
                return templates[i](text) if tokens is None else templates[i](text, tokens)
            body = resp.completion_chunk_choice(i, text, finish, tokens, lp)
            if prompt_lp is not None:
                body["prompt_logprobs"] = prompt_lp
            return head.body([body])

        def whole(outs: list[RequestOutput]) -> dict:
            body = [resp.completion_choice(i, o, text_of, req.return_token_ids) for i, o in enumerate(outs)]
            if echoed is not None or scored:
                body = [echo.echo_choice(c, req, o, echoed[i // req.n] if echoed else "", text_of)
                        for i, (c, o) in enumerate(zip(body, outs))]
            return head.body(body, usage=_usage(prompts, outs))

        return await _respond(request, req, choices, head, chunk, whole, prompts)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(request, proto.ChatCompletionRequest)
        _check_model(req.model)
        _check_n(req.n)
        if state.chat_template is None:
            raise proto.BadRequest(f"{state.model_name} has no chat template; use /v1/completions")
        tools = tool_calls.template_tools(req)
        if tools is not None:  # the template sees them as one more variable
            req.chat_template_kwargs = {**(req.chat_template_kwargs or {}), "tools": tools}
        messages = [m.as_template_message() for m in req.messages]
        add_generation_prompt, template_kwargs = proto.chat_template_kwargs(req)
        big = sum(len(m.get("content") or "") for m in messages) > OFF_LOOP_BYTES
        text = await _off_loop(big, _render, messages, add_generation_prompt, template_kwargs)
        [prompt] = await _tokens([text], add_special_tokens=False)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, state.max_model_len - len(prompt))
        if req.top_logprobs and not req.logprobs:
            raise proto.BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        choices = [Choice(prompt, _params(req, max_tokens, logprobs, i)) for i in range(req.n)]
        head = resp.ResponseHead("chat.completion.chunk" if req.stream else "chat.completion", state.model_name,
                                 resp.new_id("chatcmpl"))
        output = ChatOutputFormat(state.reasoning_parser, state.tool_call_parser if tools is not None else None, text,
                                  max_tool_calls=1 if req.parallel_tool_calls is False else None)
        streams = [output.stream() for _ in choices]
        ids = resp.TOKENS_SLOT if req.return_token_ids else None
        plain = req.stream and not (output.reasoning_parser or output.tool_call_parser)  # content deltas only
        templates = [resp.chunk_template(head.body([resp.chat_chunk_choice(i, {"content": resp.TEXT_SLOT}, None, ids)]))
                     for i in range(len(choices))] if plain else []

        def chunk(i: int, text: str, finish: str | None, tokens: list[int] | None, first: bool,
                  upd: RequestUpdate | None = None) -> list[dict]:
            lp = None
            if upd is not None and upd.new_tokens and upd.new_log_probs is not None:
                lp = resp.chat_logprobs(upd.new_tokens, upd.new_log_probs, upd.new_top_n_logprobs, text_of)
            if templates and lp is None and not finish and not first:  # the common chunk: its text (and ids)
                return [templates[i](text) if tokens is None else templates[i](text, tokens)]
            deltas = streams[i].feed(text) + (streams[i].finish() if finish else [])
            finish = streams[i].finish_reason(finish) if finish else None
            return [head.body([c]) for c in chunk_choices(i, deltas, first, finish, tokens, lp)]

        def whole(outs: list[RequestOutput]) -> dict:
            body = [resp.chat_choice(i, o, text_of, req.return_token_ids) for i, o in enumerate(outs)]
            for c, o in zip(body, outs):
                c["message"], c["finish_reason"] = output.message(o.generated_text or "", o.finish_reason)
            return head.body(body, usage=_usage([prompt], outs))

        return await _respond(request, req, choices, head, chunk, whole, [prompt])

    # ------------------------------------------------------------------ helpers
    async def _off_loop(big: bool, fn: Callable, *args):
        """``fn(*args)`` on the thread pool when its input is big, else right here."""
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args) if big else fn(*args)

    async def _parse(request: Request, model: type):
        """The body as ``model``: content type, size, JSON and fields checked (see request_body.py)."""
        request_body.check_content_type(request.headers.get("content-type"))
        request_body.check_content_length(request.headers.get("content-length"), state.max_request_bytes)
        raw = await request_body.read_limited(request.stream(), state.max_request_bytes)
        return await _off_loop(len(raw) > OFF_LOOP_BYTES, lambda: proto.parse_body(model, request_body.decode_json(raw)))

    def _check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise proto.NotFound(f"model {name!r} does not exist; this server serves {state.model_name!r}", "model")

    def _check_n(n: int) -> None:
        if n > state.max_requests:
            raise proto.BadRequest(f"n={n} is more than the {state.max_requests} requests this engine runs at once "
                                   "(--max-requests)", "n")

    def _render(messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            return state.chat_template.render(messages, add_generation_prompt, **kwargs)
        except ChatTemplateError as e:
            raise proto.BadRequest(str(e), "messages") from None

    async def _tokens(prompts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each prompt; text longer than any prompt that fits is refused untokenized."""
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and state.tokenizer is None:
            raise proto.BadRequest("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        for t in texts:
            if len(t) > prompt_chars:
                raise proto.BadRequest(f"the prompt is {len(t)} characters: more than {state.max_model_len} tokens "
                                       "(the most a request may hold) can cover", "prompt")

        def encode() -> list[list[int]]:
            return [state.tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str)
                    else list(p) for p in prompts]

        return await _off_loop(sum(len(t) for t in texts) > OFF_LOOP_BYTES, encode)

    def _params(req, max_tokens: int, logprobs: int | None, i: int):
        sp = proto.sampling_params(req, max_tokens, logprobs)
        if sp.seed is not None and i:  # n samples of one seeded request must differ
            sp.seed = (sp.seed + i) % 2**63
        return sp

    def _usage(prompts: list[list[int]], outs: list[RequestOutput]) -> dict:
        return resp.usage(sum(len(p) for p in prompts), sum(len(o.generated_tokens) for o in outs))

    async def _respond(request: Request, req, choices: list[Choice], head: resp.ResponseHead,
                       chunk: Callable, whole: Callable, prompts: list[list[int]]):
        sub = Submission(choices, asyncio.get_running_loop())
        state.engine_loop.submit(sub)
        try:
            await sub.admitted
        except InvalidRequestError as e:
            return _error(str(e), 400)
        except RuntimeError as e:
            return _error(str(e), 500)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            events = _stream(sub, head, chunk, prompts if include_usage else None, req.return_token_ids)
            return SSEResponse(events, on_close=lambda: state.engine_loop.abort(sub))
        try:
            outs = await _collect(request, sub)
        except _ClientGone:
            return Response(status_code=499)
        except RuntimeError as e:
            return _error(str(e), 500)
        return whole(outs)

    async def _collect(request: Request, sub: Submission) -> list[RequestOutput]:
        """Wait for every choice's final output; abort them as soon as the client goes away
        (a watcher waits for the ASGI disconnect message: no polling interval to race with)."""
        outs: list[RequestOutput | None] = [None] * len(sub.choices)
        done = 0
        gone = asyncio.ensure_future(client_disconnect(request.receive))
        try:
            while done < len(outs):
                nxt = asyncio.ensure_future(sub.events.get())
                ready, _ = await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in ready:
                    nxt.cancel()
                    state.engine_loop.abort(sub)
                    raise _ClientGone()
                ev = nxt.result()
                error = ev.error or (ev.output.error if ev.output is not None and ev.output.finish_reason == "error" else None)
                if error is not None:
                    state.engine_loop.abort(sub)
                    raise RuntimeError(error)
                if ev.output is not None:
                    outs[ev.index] = ev.output
                    done += 1
        finally:
            gone.cancel()
        return outs

    async def _stream(sub: Submission, head: resp.ResponseHead, chunk: Callable, usage_prompts: list[list[int]] | None,
                      token_ids: bool) -> AsyncIterator[str]:
        """SSE chunks as the engine produces them (the response aborts what is left when it ends).
        Everything waiting for this request goes out in one write, with one chunk per choice
        for all its new tokens (``merge_updates``): an event loop that falls behind the engine
        catches up with fewer, larger chunks instead of one per token."""
        n = len(sub.choices)
        started, finished, generated = [False] * n, 0, 0
        while finished < n:
            events = [await sub.events.get()]
            while not sub.events.empty():
                events.append(sub.events.get_nowait())
            error, updates, outputs = merge_events(events)
            parts = []
            for i, upd in updates.items():
                if upd.new_tokens or upd.new_text or not started[i]:
                    generated += len(upd.new_tokens)
                    tokens = list(upd.new_tokens) if token_ids else None
                    parts.append(resp.sse(chunk(i, upd.new_text or "", None, tokens, not started[i], upd)))
                    started[i] = True
            for i, out in outputs.items():
                tokens = [] if token_ids else None
                parts.append(resp.sse(chunk(i, "", out.finish_reason, tokens, not started[i])))
                started[i] = True
                finished += 1
            if error is not None:  # end the stream; SSEResponse aborts the other choices
                parts.append(resp.sse(resp.error_body(error, 500)))
                yield "".join(parts)
                return
            if parts:
                yield "".join(parts)
        tail = [resp.sse("[DONE]")]
        if usage_prompts is not None:
            tail.insert(0, resp.sse(head.body([], usage=resp.usage(sum(len(p) for p in usage_prompts), generated))))
        yield "".join(tail)

    return app
