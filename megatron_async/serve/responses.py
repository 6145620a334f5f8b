"""What every endpoint's answer is made of, and how it goes out. The parts each endpoint's
formatter builds on (ids, the ``ResponseHead`` every body of a request repeats, JSON templates for
stream chunks, usage, token texts for log-probs); then ``respond``: a route's choices handed to
the engine thread (engine_loop.py, or its stand-in), and either every choice's final output as one
JSON body (the endpoint's ``whole``) or the updates as they come as server-sent events (its
``chunk``, sse_response.py). A client that goes away has its requests aborted. Errors are OpenAI's
JSON error object."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from megatron_async.dp_engine.engine_ops import error_body
from megatron_async.inference.request import InvalidRequestError, RequestOutput, RequestUpdate
from megatron_async.serve.engine_loop import EngineLoop
from megatron_async.serve.sse_response import SSEResponse, client_disconnect
from megatron_async.serve.submission import Choice, ChoiceEvent, GenerationBlockedError, Submission

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict | str | list[dict]) -> str:
    """One server-sent event (``data: [DONE]`` for the end marker); a list: one event per body."""
    if isinstance(data, list):
        return "".join(sse(d) for d in data)
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


TEXT_SLOT = "\x00text\x00"
TOKENS_SLOT = "\x00tokens\x00"
"""Placeholders for JsonTemplate's variable fields (their JSON forms, with escaped NULs, cannot
occur elsewhere in a body)."""


class JsonTemplate:
    """``json.dumps`` of a body whose few fields vary from chunk to chunk (a stream chunk's text,
    its token ids): the rest is encoded once, so each chunk costs the encoding of its variable
    values only. ``slots``: the placeholders the body holds, in the order ``__call__`` takes
    their values."""

    def __init__(self, body: dict, slots: tuple[str, ...] = (TEXT_SLOT,)):
        text = json.dumps(body, ensure_ascii=False)
        marks = sorted((text.index(json.dumps(s)), k, json.dumps(s)) for k, s in enumerate(slots))
        self._parts, self._order, at = [], [], 0
        for pos, k, mark in marks:
            self._parts.append(text[at:pos])
            self._order.append(k)
            at = pos + len(mark)
        self._parts.append(text[at:])

    def __call__(self, *values) -> str:
        out = [self._parts[0]]
        for part, k in zip(self._parts[1:], self._order):
            out.append(json.dumps(values[k], ensure_ascii=False))
            out.append(part)
        return "".join(out)


def chunk_template(body: dict) -> JsonTemplate:
    """A stream chunk built with ``TEXT_SLOT`` for its text and, with ``return_token_ids``,
    ``TOKENS_SLOT`` for its ids: called with the text, then the ids where the body holds them."""
    slots = (TEXT_SLOT, TOKENS_SLOT) if json.dumps(TOKENS_SLOT) in json.dumps(body) else (TEXT_SLOT,)
    return JsonTemplate(body, slots)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def outputs_usage(prompts: list[list[int]], outs: list[RequestOutput]) -> dict:
    """The usage of a whole answer: its prompts and every generated token of ``outs``."""
    return usage(sum(len(p) for p in prompts), sum(len(o.generated_tokens) for o in outs))


def with_usage(chunk: dict | str | list, counts: dict) -> dict | str | list:
    """A stream chunk (a body, its JSON text from a template, or a list of bodies) carrying
    ``usage`` = ``counts`` (``stream_options.continuous_usage_stats``)."""
    if isinstance(chunk, list):
        return [with_usage(c, counts) for c in chunk]
    if isinstance(chunk, str):  # a JSON object's text: the field goes in before its closing brace
        return f'{chunk[:-1]}, "usage": {json.dumps(counts)}}}'
    return {**chunk, "usage": counts}


@dataclass
class ResponseHead:
    """What every body and chunk of one HTTP request repeats."""

    object: str
    model: str
    id: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}


class TokenText:
    """Token id -> its text, for log-prob entries (cached: the same ids recur)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self._cache:
            self._cache[token] = self._tok.decode([token]) if self._tok is not None else f"<{token}>"
        return self._cache[token]


class _ClientGone(Exception):
    pass


def error_response(message: str, status: int = 400, param: str | None = None) -> Response:
    # ASCII JSON: a message quoting the request (a lone surrogate included) always encodes
    return Response(json.dumps(error_body(message, status, param)), status_code=status,
                    media_type="application/json")


async def respond(engine_loop: EngineLoop, request: Request, req, choices: list[Choice], head: ResponseHead,
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
    if not req.stream:
        try:
            outs = await _collect(engine_loop, request, sub)
        except _ClientGone:
            return Response(status_code=499)
        except RuntimeError as e:
            return error_response(str(e), 500)
        return whole(outs)
    options = req.stream_options
    include_usage = options is not None and options.include_usage
    events = _stream(sub, head, chunk, prompts if include_usage else None, req.return_token_ids,
                     include_usage and options.continuous_usage_stats)
    return SSEResponse(events, on_close=lambda: engine_loop.abort(sub))


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


async def _stream(sub: Submission, head: ResponseHead, chunk: Callable, usage_prompts: list[list[int]] | None,
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
        return with_usage(body, usage(len(sub.choices[i].prompt_tokens), counts[i]))

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
                parts.append(sse(counted(i, chunk(i, upd.new_text or "", None, tokens, not started[i], upd))))
                started[i] = True
        for i, out in outputs.items():
            tokens = [] if token_ids else None
            parts.append(sse(counted(i, chunk(i, "", out.finish_reason, tokens, not started[i]))))
            started[i] = True
            finished += 1
        if error is not None:  # end the stream; SSEResponse aborts the other choices
            parts.append(sse(error_body(error, 500)))
            yield "".join(parts)
            return
        if parts:
            yield "".join(parts)
    tail = [sse("[DONE]")]
    if usage_prompts is not None:
        tail.insert(0, sse(head.body([], usage=usage(sum(len(p) for p in usage_prompts), generated))))
    yield "".join(tail)


def merge_updates(a: RequestUpdate, b: RequestUpdate) -> RequestUpdate:
    """One update holding ``a`` then ``b`` (two steps of one request), as if one step made both."""
    text = None if a.new_text is None and b.new_text is None else (a.new_text or "") + (b.new_text or "")
    lps = None if a.new_log_probs is None else a.new_log_probs + (b.new_log_probs or ())
    tops = None if a.new_top_n_logprobs is None else a.new_top_n_logprobs + (b.new_top_n_logprobs or ())
    prompt = a if a.prompt_log_probs is not None else b
    return RequestUpdate(a.request_id, a.new_tokens + b.new_tokens, text, b.finished, b.finish_reason, lps, tops,
                         prompt.prompt_log_probs, prompt.prompt_top_n_logprobs)


def merge_events(events: list[ChoiceEvent]) -> tuple[str | None, dict[int, RequestUpdate], dict[int, RequestOutput]]:
    """A stream's waiting events, in order, as (the first error, if any; each choice's updates
    merged into one; each choice's final output). Events after an error are dropped: the stream
    ends there."""
    updates: dict[int, RequestUpdate] = {}
    outputs: dict[int, RequestOutput] = {}
    for ev in events:
        out = ev.output
        if ev.error is not None:
            return ev.error, updates, outputs
        if out is not None and out.finish_reason == "error":
            return out.error or "request failed", updates, outputs
        if ev.update is not None:
            prev = updates.get(ev.index)
            updates[ev.index] = ev.update if prev is None else merge_updates(prev, ev.update)
        if out is not None:
            outputs[ev.index] = out
    return None, updates, outputs
