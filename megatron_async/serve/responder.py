"""From engine events to an HTTP response: a route's choices handed to the engine thread
(engine_loop.py), then either every choice's final output as one JSON body or the updates as
they come as server-sent events. A client that goes away has its requests aborted. Errors are
OpenAI's JSON error object."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from megatron_async.inference.request import InvalidRequestError, RequestOutput
from megatron_async.serve import responses as resp
from megatron_async.serve.engine_loop import EngineLoop
from megatron_async.serve.sse_response import SSEResponse, client_disconnect
from megatron_async.serve.stream_events import merge_events
from megatron_async.serve.submission import Choice, GenerationBlockedError, Submission


class _ClientGone(Exception):
    pass


def error_response(message: str, status: int = 400, param: str | None = None) -> Response:
    # ASCII JSON: a message quoting the request (a lone surrogate included) always encodes
    return Response(json.dumps(resp.error_body(message, status, param)), status_code=status,
                    media_type="application/json")


def usage(prompts: list[list[int]], outs: list[RequestOutput]) -> dict:
    return resp.usage(sum(len(p) for p in prompts), sum(len(o.generated_tokens) for o in outs))


async def respond(engine_loop: EngineLoop, request: Request, req, choices: list[Choice], head: resp.ResponseHead,
                  chunk: Callable, whole: Callable, prompts: list[list[int]]):
    """Run ``choices`` (for body ``req``) and answer: ``whole(outputs)`` as JSON, or with
    ``req.stream`` an SSE stream of ``chunk(i, text, finish, tokens, first, update)`` bodies."""
    sub = Submission(choices, asyncio.get_running_loop())
    engine_loop.submit(sub)
    try:
        await sub.admitted
    except InvalidRequestError as e:
        return error_response(str(e), 400)
    except GenerationBlockedError as e:
        return error_response(str(e), 503)
    except RuntimeError as e:
        return error_response(str(e), 500)
    if req.stream:
        options = req.stream_options
        include_usage = options is not None and options.include_usage
        events = _stream(sub, head, chunk, prompts if include_usage else None, req.return_token_ids,
                         include_usage and options.continuous_usage_stats)
        return SSEResponse(events, on_close=lambda: engine_loop.abort(sub))
    try:
        outs = await _collect(engine_loop, request, sub)
    except _ClientGone:
        return Response(status_code=499)
    except RuntimeError as e:
        return error_response(str(e), 500)
    return whole(outs)


async def _collect(engine_loop: EngineLoop, request: Request, sub: Submission) -> list[RequestOutput]:
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
                engine_loop.abort(sub)
                raise _ClientGone()
            ev = nxt.result()
            error = ev.error or (ev.output.error if ev.output is not None and ev.output.finish_reason == "error" else None)
            if error is not None:
                engine_loop.abort(sub)
                raise RuntimeError(error)
            if ev.output is not None:
                outs[ev.index] = ev.output
                done += 1
    finally:
        gone.cancel()
    return outs


async def _stream(sub: Submission, head: resp.ResponseHead, chunk: Callable, usage_prompts: list[list[int]] | None,
                  token_ids: bool, continuous: bool = False) -> AsyncIterator[str]:
    """SSE chunks as the engine produces them (the response aborts what is left when it ends).
    Everything waiting for this request goes out in one write, with one chunk per choice
    for all its new tokens (``merge_updates``): an event loop that falls behind the engine
    catches up with fewer, larger chunks instead of one per token. ``continuous``: each chunk
    carries its choice's usage so far."""
    n = len(sub.choices)
    started, finished, generated, counts = [False] * n, 0, 0, [0] * n

    def counted(i: int, body):
        if not continuous:
            return body
        return resp.with_usage(body, resp.usage(len(sub.choices[i].prompt_tokens), counts[i]))

    while finished < n:
        events = [await sub.events.get()]
        while not sub.events.empty():
            events.append(sub.events.get_nowait())
        error, updates, outputs = merge_events(events)
        parts = []
        for i, upd in updates.items():
            if upd.new_tokens or upd.new_text or not started[i]:
                generated += len(upd.new_tokens)
                counts[i] += len(upd.new_tokens)
                tokens = list(upd.new_tokens) if token_ids else None
                parts.append(resp.sse(counted(i, chunk(i, upd.new_text or "", None, tokens, not started[i], upd))))
                started[i] = True
        for i, out in outputs.items():
            tokens = [] if token_ids else None
            parts.append(resp.sse(counted(i, chunk(i, "", out.finish_reason, tokens, not started[i]))))
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
