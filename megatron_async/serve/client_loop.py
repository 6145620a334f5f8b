"""The OpenAI server in front of engines behind a data-parallel coordinator
(``python -m megatron_async.serve --engine tcp://HOST:PORT``): app.py's engine-loop interface
(submit / abort / admin / healthy / metrics_text / adapters) over an ``InferenceClient``, on the
serving event loop. HTTP then scales apart from the GPU job; ``--model`` names the checkpoint
only for its tokenizer and chat template.

Choices reach the engines in the fair order of fair_feed.py, as from the engine loop of a server
with its own engine: this front-end keeps at most as many of them in the engines as the
engines have places (the live engines' ``max_requests`` summed, read from the coordinator every
``CAPACITY_REFRESH_S``), the rest wait here, so a short request is never queued in an engine
behind a huge body's thousands of prompts. Choices handed out together with one prompt go as
one group (the ``n`` samples of a prompt are placed on one engine when it has room), every
choice streaming: each update and final output becomes the submission's ``ChoiceEvent``,
exactly as from an engine thread in this process. A submission counts as admitted at its first
event (its first token, usually) and as refused when an engine refuses one of its choices (the
others are aborted). The admin endpoints become control operations on every engine."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from megatron_async.client.client import ControlError, InferenceClient
from megatron_async.config import InferenceConfig
from megatron_async.inference.request import InvalidRequestError, RequestOutput, RequestUpdate
from megatron_async.serve.fair_feed import FairFeed
from megatron_async.serve.metrics import ServerMetrics
from megatron_async.serve.submission import ChoiceEvent, Submission, unsent_abort

log = logging.getLogger("megatron_async.serve")
HEALTH_TIMEOUT_S = 5.0
CAPACITY_REFRESH_S = 5.0
"""How often the engines' places are read from the coordinator."""


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
            self.loop.ended(sub, self.index)
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
            self.loop.ended(sub, self.index)
            metrics.e2e.observe(time.perf_counter() - sub.arrival)
            metrics.finished(item.finish_reason)
            sub.events.put_nowait(ChoiceEvent(self.index, output=item))


class ClientEngineLoop:
    def __init__(self, client: InferenceClient, metrics: ServerMetrics, places: int = 64,
                 aging: int = InferenceConfig.priority_aging):
        """``client``: connected (``connect``) before serving; it attaches to the serving event
        loop at its first use. ``places``: the engines' places until the coordinator tells;
        ``aging``: the engines' ``priority_aging``."""
        self.client, self.metrics = client, metrics
        self.feed = FairFeed(places, aging)
        """The order in which submissions' choices reach the engines (fair_feed.py)."""
        self._watch: asyncio.Task | None = None
        self._pump_due = False
        """A ``_pump`` is scheduled for this turn of the event loop."""

    def start(self) -> None:
        """(The engine runs elsewhere: nothing to start.)"""

    def is_alive(self) -> bool:
        return self.client.lost is None

    def stop(self, timeout: float = 10.0) -> None:
        self.client.close()  # (the watch of the engines' places ends with the client)

    def submit(self, sub: Submission) -> None:
        """Every choice goes out now when the body fits the engines' free places, else in the
        fair order as places free up."""
        self._bind()
        n = len(sub.choices)
        sub.request_ids[:] = [-1] * n
        if self.feed.fits(n):
            self.feed.place(sub, n)
            self._send(sub, range(n))
        else:
            self.feed.add(sub, sub.choices[0].params.priority)
            self._pump()

    def ended(self, sub: Submission, index: int) -> None:
        """A choice of ``sub`` that went out ended: its place goes to the next in the fair order,
        once the outputs that came with it are read (places freed together fill together, so
        choices of one prompt still go as one group)."""
        self.feed.ended(sub, index)
        if not self._pump_due:
            self._pump_due = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_due = False
        by_sub: dict[int, tuple[Submission, list[int]]] = {}
        for sub, i in self.feed.take():
            by_sub.setdefault(id(sub), (sub, []))[1].append(i)
        for sub, indices in by_sub.values():
            self._send(sub, indices)

    def _send(self, sub: Submission, indices) -> None:
        """Choices ``indices`` (ascending) of ``sub`` to the coordinator; runs of consecutive ones
        with one prompt go as one group."""
        run: list[int] = []
        for k, i in enumerate(indices):
            run.append(i)
            last = k + 1 == len(indices)
            if last or indices[k + 1] != i + 1 or sub.choices[i + 1].prompt_tokens != sub.choices[i].prompt_tokens:
                if not self._send_group(sub, run):
                    for j in indices[k + 1:]:  # the submission failed: its places taken for them are free
                        self.feed.ended(sub, j)
                    return
                run = []

    def _send_group(self, sub: Submission, run: list[int]) -> bool:
        prompt = sub.choices[run[0]].prompt_tokens
        sinks = [_ChoiceSink(self, sub, i) for i in run]
        try:
            self.client.add_group_streaming(prompt, [sub.choices[i].params for i in run], sinks)
        except Exception as e:  # noqa: BLE001 -- the coordinator is gone: this request fails, the server stays
            for i in run:
                self.feed.ended(sub, i)
            self.abort(sub)
            error = RuntimeError(f"the engines cannot be reached: {e}")
            if not sub.admitted.done():
                sub.admitted.set_exception(error)
            else:
                for i in run:
                    sub.events.put_nowait(ChoiceEvent(i, error=str(error)))
            return False
        for sink in sinks:
            sub.request_ids[sink.index] = sink.request_id
        self.metrics.prompt_tokens.inc(len(prompt) * len(run))
        return True

    def abort(self, sub: Submission) -> None:
        """Its choices in the engines are aborted there; those that never went out end here."""
        for i in self.feed.drop(sub):
            self.metrics.finished("abort")
            sub.events.put_nowait(unsent_abort(sub, i))
        for rid in sub.request_ids:
            if rid >= 0:
                self.client.abort_request(rid)

    def _bind(self) -> None:
        """Attach the client to the running event loop and start reading the engines' places."""
        self.client.bind_running_loop()
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_places())

    async def _watch_places(self) -> None:
        while self.client.lost is None:
            try:
                self._count_places(await asyncio.wait_for(self.client.engines(), HEALTH_TIMEOUT_S))
            except (asyncio.TimeoutError, ConnectionError, RuntimeError) as e:
                log.debug("the engines' places were not read: %s", e)
            await asyncio.sleep(CAPACITY_REFRESH_S)

    def _count_places(self, listing: dict) -> None:
        places = sum(e["max_requests"] for e in listing["engines"] if e["state"] == "active")
        if places and places != self.feed.max_requests:
            self.feed.resize(places)
            self._pump()

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
        self._bind()
        try:
            listing = await asyncio.wait_for(self.client.engines(), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, RuntimeError):
            return False
        self._count_places(listing)
        return any(e["state"] == "active" for e in listing["engines"])

    async def metrics_text(self) -> bytes:
        """/metrics: this front-end's own counters (the engines' are theirs)."""
        return self.metrics.render()

    async def adapters(self) -> list[str] | None:
        """The adapters some engine holds, as the coordinator last told this client (it tells
        whenever they change: coordinator/adapters.py)."""
        return self.client.adapters()


def serve_over_client(args, model_name: str) -> int:
    """``python -m megatron_async.serve --engine ADDR``: the OpenAI server on this process's event
    loop, its engine loop a client of the coordinator at ADDR."""
    import sys

    from megatron_async.client.client import InferenceClient
    from megatron_async.coordinator.transport import AuthError
    from megatron_async.coordinator.trust import SecretError
    from megatron_async.models.chat_template import load_chat_template
    from megatron_async.serve.http_guard import policy_from_args
    from megatron_async.serve.launch import Serving, serve_until_stopped
    from megatron_async.serve.server_state import ServerState
    from megatron_async.serve.chat_output import choose_parser

    try:
        client = InferenceClient(args.engine).connect()
    except (AuthError, SecretError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    state = ServerState(
        engine_loop=ClientEngineLoop(client, ServerMetrics(model_name),
                                     aging=args.priority_aging or InferenceConfig.priority_aging),
        model_name=model_name, tokenizer=_tokenizer(args),
        chat_template=load_chat_template(args.model, args.chat_template),
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
