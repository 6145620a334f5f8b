"""The OpenAI server in front of engines behind a data-parallel coordinator
(``python -m megatron_async.serve --engine tcp://HOST:PORT``): app.py's engine-loop interface
(submit / abort / admin / healthy / metrics_text) over an ``InferenceClient``, on the serving
event loop. HTTP then scales apart from the GPU job; ``--model`` names the checkpoint only for
its tokenizer and chat template.

A submission's choices go out as one group per prompt (the ``n`` samples of a prompt are placed
on one engine when it has room), every choice streaming: each update and final output becomes
the submission's ``ChoiceEvent``, exactly as from an engine thread in this process. A
submission counts as admitted at its first event (its first token, usually) and as refused when
an engine refuses one of its choices (the others are aborted). The admin endpoints become
control operations on every engine."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from megatron_async.client.client import ControlError, InferenceClient
from megatron_async.inference.request import InvalidRequestError, RequestOutput, RequestUpdate
from megatron_async.serve.metrics import ServerMetrics
from megatron_async.serve.submission import ChoiceEvent, Submission

HEALTH_TIMEOUT_S = 5.0


class _ChoiceSink:
    """Where the client puts one choice's updates and end (``InferenceClient.add_group_streaming``)."""

    __slots__ = ("request_id", "loop", "sub", "index", "last_token_at")

    def __init__(self, loop: ClientEngineLoop, sub: Submission, index: int):
        self.request_id, self.loop, self.sub, self.index, self.last_token_at = -1, loop, sub, index, None

    def put(self, item: Any) -> None:
        sub, metrics = self.sub, self.loop.metrics
        if isinstance(item, BaseException):
            if not sub.admitted.done():
                self.loop.abort(sub)
                sub.admitted.set_exception(item if isinstance(item, InvalidRequestError) else RuntimeError(str(item)))
            else:
                sub.events.put_nowait(ChoiceEvent(self.index, error=str(item)))
            return
        if not sub.admitted.done():
            sub.admitted.set_result(list(sub.request_ids))
        if isinstance(item, RequestUpdate):
            if item.new_tokens:
                now = time.perf_counter()
                if self.last_token_at is None:
                    metrics.ttft.observe(now - sub.arrival)
                self.last_token_at = now
                metrics.generation_tokens.inc(len(item.new_tokens))
            sub.events.put_nowait(ChoiceEvent(self.index, item))
        elif isinstance(item, RequestOutput):
            metrics.e2e.observe(time.perf_counter() - sub.arrival)
            metrics.finished(item.finish_reason)
            sub.events.put_nowait(ChoiceEvent(self.index, output=item))


class ClientEngineLoop:
    def __init__(self, client: InferenceClient, metrics: ServerMetrics):
        """``client``: connected (``connect``) before serving; it attaches to the serving event
        loop at its first use."""
        self.client, self.metrics = client, metrics

    def start(self) -> None:
        """(The engine runs elsewhere: nothing to start.)"""

    def is_alive(self) -> bool:
        return self.client.lost is None

    def stop(self, timeout: float = 10.0) -> None:
        self.client.close()

    def submit(self, sub: Submission) -> None:
        """Every choice goes out now; groups of consecutive choices with one prompt go together."""
        self.client.bind_running_loop()
        sinks = [_ChoiceSink(self, sub, i) for i in range(len(sub.choices))]
        start = 0
        while start < len(sub.choices):
            prompt = sub.choices[start].prompt_tokens
            end = start + 1
            while end < len(sub.choices) and sub.choices[end].prompt_tokens == prompt:
                end += 1
            try:
                self.client.add_group_streaming(prompt, [c.params for c in sub.choices[start:end]], sinks[start:end])
            except Exception as e:  # noqa: BLE001 -- the coordinator is gone: this request fails, the server stays
                self.abort(sub)
                sub.admitted.set_exception(RuntimeError(f"the engines cannot be reached: {e}"))
                return
            self.metrics.prompt_tokens.inc(len(prompt) * (end - start))
            start = end
        sub.request_ids[:] = [s.request_id for s in sinks]

    def abort(self, sub: Submission) -> None:
        for rid in sub.request_ids:
            self.client.abort_request(rid)

    async def admin(self, op: str, args: dict) -> tuple[int, dict]:
        """An admin route as a control operation on every engine: (status, each engine's answer)."""
        self.client.bind_running_loop()
        try:
            return 200, await self.client.control(op, args)
        except ControlError as e:
            return e.status, e.body
        except (ConnectionError, RuntimeError) as e:
            return 503, {"error": {"message": str(e), "type": "server_error", "code": 503}}

    async def healthy(self) -> bool:
        """/health: the coordinator answers and has an engine."""
        self.client.bind_running_loop()
        try:
            listing = await asyncio.wait_for(self.client.engines(), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, RuntimeError):
            return False
        return any(e["state"] == "active" for e in listing["engines"])

    async def metrics_text(self) -> bytes:
        """/metrics: this front-end's own counters (the engines' are theirs)."""
        return self.metrics.render()


def serve_over_client(args, model_name: str) -> int:
    """``python -m megatron_async.serve --engine ADDR``: the OpenAI server on this process's event
    loop, its engine loop a client of the coordinator at ADDR."""
    import sys

    from megatron_async.client.client import InferenceClient
    from megatron_async.coordinator.transport import AuthError
    from megatron_async.coordinator.trust import SecretError
    from megatron_async.models.chat_template import load_chat_template
    from megatron_async.serve.http_flags import policy_from_args
    from megatron_async.serve.launch import Serving, serve_until_stopped
    from megatron_async.serve.server_state import ServerState
    from megatron_async.serve.tool_calls import choose_parser

    try:
        client = InferenceClient(args.engine).connect()
    except (AuthError, SecretError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    state = ServerState(
        engine_loop=ClientEngineLoop(client, ServerMetrics(model_name)), model_name=model_name,
        tokenizer=_tokenizer(args), chat_template=load_chat_template(args.model) if args.model else None,
        max_model_len=args.max_sequence_length or 4096, max_requests=args.max_requests or 64,
        max_request_bytes=args.max_request_bytes, admin_endpoints=args.enable_admin_endpoints,
        policy=policy_from_args(args))
    state.tool_call_parser = choose_parser(args.tool_call_parser, state.chat_template)
    state.reasoning_parser = args.reasoning_parser
    serving = Serving(state, args.host, args.port, api_server_count=0, log_level=args.log_level)
    return serve_until_stopped(serving, args.host, args.port, f" over the engines at {args.engine}")


def _tokenizer(args):
    """The checkpoint's tokenizer, or the built-in tiny model's (other built-in models have none)."""
    if args.model:
        from megatron_async.models.tokenizer import load_tokenizer

        return load_tokenizer(args.model)
    if (args.default_model or "").startswith("tiny"):
        from megatron_async.models.tiny_tokenizer import EOS_TOKEN_ID, train_tiny_tokenizer
        from megatron_async.models.tokenizer import Tokenizer

        return Tokenizer(train_tiny_tokenizer(), EOS_TOKEN_ID)
    return None
