"""``InferenceClient``: requests, aborts and control operations to the engines behind a
data-parallel coordinator, from any process, on an asyncio event loop.

    client = InferenceClient("tcp://127.0.0.1:5555")
    await client.start()                                   # connect and authenticate
    out = await client.add_request([1, 2, 3], SamplingParams(num_tokens_to_generate=8))
    stream = client.add_request_streaming("Hello", params)
    async for update in stream: ...                        # RequestUpdate, then stream.output
    futures = client.add_group(prompt, [params] * 8)       # a GRPO group, on one engine when it fits
    client.abort_request(futures[0].request_id); client.abort_all()
    await client.pause_engines("keep"); await client.suspend_engines(); ...
    await client.resume_engines(); await client.update_weights(path=...); await client.set_generation_epoch(3)
    await client.unpause_engines(); await client.stop_engines(); await client.shutdown(); client.close()

Request ids are the client's own (``RequestFuture.request_id``, ``RequestOutput.request_id``).
A request ends exactly once: its output (finish_reason "length" / "stop" / "abort", or "error"
with ``error`` set and the partial output when its engine died after it produced tokens), or
``InvalidRequestError`` when the engine refused it. Token-id prompts are hashed here into the
prefix cache's block digests (the coordinator says which block size and key): the coordinator
routes on them and the engine it picks reads them instead of hashing the prompt again; text
prompts are tokenized here when a tokenizer is given, else routed by load.
Control operations return once every engine answered, with each engine's answer
(``ControlError`` when one refused). If the coordinator goes away every open request fails with
``CoordinatorLost`` and nothing waits forever. ``SyncInferenceClient`` (sync.py) is the same from
synchronous code."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

from megatron_async.coordinator.controls import WEIGHT_TRANSFER_OPS
from megatron_async.inference.contexts.kv_block_allocator import prefix_digests
from megatron_async.inference.records import encode_sampling
from megatron_async.inference.request import InvalidRequestError, RequestOutput, RequestUpdate, SamplingParams


class CoordinatorLost(ConnectionError):
    """The coordinator's connection closed (its process exited or died)."""


class ControlError(RuntimeError):
    """A control operation some engine refused: ``status`` (400 bad input, 409 not now, 404 no
    such engine) and ``body`` (each engine's answer)."""

    def __init__(self, op: str, status: int, body: Any):
        super().__init__(f"{op} failed on some engine (status {status}): {body}")
        self.status, self.body = status, body


class RequestFuture:
    """Awaitable: the request's ``RequestOutput`` (InvalidRequestError if it was refused)."""

    __slots__ = ("request_id", "_future")

    def __init__(self, request_id: int, future: asyncio.Future):
        self.request_id, self._future = request_id, future

    def __await__(self):
        return self._future.__await__()

    def done(self) -> bool:
        return self._future.done()


class RequestStream:
    """Async iterator of a request's ``RequestUpdate``s; once it ends, ``output`` holds its
    ``RequestOutput``. Leaving the iteration early (break, cancellation) aborts the request."""

    def __init__(self, request_id: int, client: InferenceClient):
        self.request_id, self._client = request_id, client
        self._queue: asyncio.Queue = asyncio.Queue()
        self.output: RequestOutput | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestUpdate:
        if self.output is not None and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, RequestUpdate):
            return item
        if isinstance(item, BaseException):
            raise item
        self.output = item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if self.output is None:
            self._client.abort_request(self.request_id)

    def put(self, item: Any) -> None:
        """(The client's) an update, the final output, or the exception that ends it."""
        self._queue.put_nowait(item)


class InferenceClient:
    def __init__(self, address: str, secret: bytes | str | None = None, tokenizer=None, timeout_s: float = 30.0):
        """``address``: the coordinator's (``tcp://HOST:PORT`` or ``ipc://PATH``). ``secret``: the
        control plane's shared secret (None: ``MEGATRON_ASYNC_CLIENT_SECRET``, then the same-user
        file the coordinator wrote for a loopback address). ``tokenizer``: text prompts are
        tokenized here (else the engine tokenizes them and they are routed by load only)."""
        self.address, self.secret, self.tokenizer, self.timeout_s = address, secret, tokenizer, timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._channel = None
        self._ids = itertools.count()
        self._futures: dict[int, asyncio.Future] = {}
        self._streams: dict[int, RequestStream] = {}
        self._controls: dict[int, tuple[str, asyncio.Future]] = {}
        self.info: dict = {}
        """What the coordinator said last: block_size, hash_key, key_epoch, engines, policy."""
        self.lost: BaseException | None = None

    # ---------------------------------------------------------------- connection
    async def start(self) -> InferenceClient:
        """Connect and authenticate (``AuthError``: refused, with what to set), on this event loop."""
        from megatron_async.client.channel import ClientChannel

        self.loop = asyncio.get_running_loop()
        self._channel = await ClientChannel.open(self.address, self.secret, self.timeout_s, self)
        return self

    def connect(self) -> InferenceClient:
        """Connect and authenticate now, blocking (before an event loop runs); the client takes the
        event loop it is first used on (``bind_running_loop``)."""
        from megatron_async.client.channel import ClientChannel

        self._channel = ClientChannel.connect(self.address, self.secret, self.timeout_s, self)
        return self

    def bind_running_loop(self) -> None:
        """After ``connect``: read the coordinator's messages on the running event loop."""
        if self.loop is None and self._channel is not None:
            self.loop = asyncio.get_running_loop()
            self._channel.attach(self.loop)

    async def __aenter__(self) -> InferenceClient:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Disconnect: the coordinator aborts this client's open requests."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self.connection_lost(CoordinatorLost("the client was closed"))

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None) -> RequestFuture:
        """Send a request; await the returned future for its ``RequestOutput``."""
        return self.add_group(prompt, [sampling_params or SamplingParams()])[0]

    def add_group(self, prompt: str | Sequence[int], sampling_params: Sequence[SamplingParams]) -> list[RequestFuture]:
        """Requests of one prompt (a GRPO group: usually the same parameters, their own seeds),
        placed on one engine when one has room for them all."""
        first = self._submit(prompt, sampling_params, stream=False)
        out = []
        for i in range(len(sampling_params)):
            fut = self.loop.create_future()
            self._futures[first + i] = fut
            out.append(RequestFuture(first + i, fut))
        return out

    def add_request_streaming(self, prompt: str | Sequence[int],
                              sampling_params: SamplingParams | None = None) -> RequestStream:
        """Send a request whose updates come as its engine produces them (``async for``)."""
        return self.add_group_streaming(prompt, [sampling_params or SamplingParams()])[0]

    def add_group_streaming(self, prompt: str | Sequence[int], sampling_params: Sequence[SamplingParams],
                            sinks: Sequence[Any] | None = None) -> list:
        """``add_group`` whose requests stream: a ``RequestStream`` each, or the given ``sinks``
        (objects with ``put(item)``, called on the loop with each ``RequestUpdate``, then the
        ``RequestOutput`` or the exception that ends the request; ``request_id`` is set on them)."""
        first = self._submit(prompt, sampling_params, stream=True)
        out = []
        for i in range(len(sampling_params)):
            sink = RequestStream(first + i, self) if sinks is None else sinks[i]
            sink.request_id = first + i
            self._streams[first + i] = sink
            out.append(sink)
        return out

    def _submit(self, prompt, params: Sequence[SamplingParams], stream: bool) -> int:
        self._check_open()
        if not params:
            raise ValueError("no sampling parameters: a group needs at least one request")
        if isinstance(prompt, str) and self.tokenizer is not None:
            prompt = self.tokenizer.encode(prompt)
        if not isinstance(prompt, str):
            prompt = list(map(int, prompt))
        digests, epoch = None, -1
        bs = self.info.get("block_size")
        if bs and not isinstance(prompt, str):
            digests, epoch = b"".join(prefix_digests(prompt, bs, self.info["hash_key"])), self.info["key_epoch"]
        try:
            maps = [encode_sampling(p) for p in params]
        except (TypeError, ValueError, OverflowError) as e:  # e.g. logit_bias keys that are not token ids
            raise InvalidRequestError(f"sampling parameters that cannot be sent: {type(e).__name__}: {e}") from None
        first = next(self._ids)
        for _ in range(len(params) - 1):
            next(self._ids)
        self._channel.send("submit", first, prompt, maps, stream, digests, epoch)
        return first

    def abort_request(self, request_id: int) -> None:
        """End a request early: its output comes with finish_reason "abort" (KV freed on its engine)."""
        if self._channel is not None and (request_id in self._futures or request_id in self._streams):
            self._channel.send("abort", int(request_id))

    def abort_all(self) -> None:
        """``abort_request`` every open request of this client."""
        if self._channel is not None:
            self._channel.send("abort_all")

    def _check_open(self) -> None:
        if self.lost is not None:
            raise CoordinatorLost(str(self.lost))
        if self._channel is None:
            raise RuntimeError("the client is not started: await client.start() first")

    # ---------------------------------------------------------------- control
    async def _control(self, kind: str, op: str, *fields: Any) -> dict:
        self._check_open()
        op_id = next(self._ids)
        done = self.loop.create_future()
        self._controls[op_id] = (op, done)
        self._channel.send(kind, op_id, *fields)
        status, body = await done
        if status != 200:
            raise ControlError(op, status, body)
        return body

    async def control(self, op: str, args: dict) -> dict:
        """Control operation ``op`` (coordinator/controls.py's names) with ``args`` on every engine."""
        return await self._control("control", op, op, args)

    async def pause_engines(self, mode: str = "keep") -> dict:
        """``engine.pause_generation(mode)`` on every engine ("keep", "wait" or "abort")."""
        return await self._control("control", "pause_generation", "pause_generation", {"mode": mode})

    async def unpause_engines(self) -> dict:
        return await self._control("control", "resume_generation", "resume_generation", {})

    async def suspend_engines(self, tags: Sequence[str] = ("weights", "kv_cache"),
                              keep_weights_on_host: bool = True) -> dict:
        """``engine.suspend``: device memory freed by tag (while paused "keep" or "abort")."""
        args = {"tags": list(tags), "keep_weights_on_host": keep_weights_on_host}
        return await self._control("control", "suspend", "suspend", args)

    async def resume_engines(self, tags: Sequence[str] = ("weights", "kv_cache")) -> dict:
        return await self._control("control", "resume", "resume", {"tags": list(tags)})

    async def set_generation_epoch(self, epoch: int) -> dict:
        """The weight version stamped on every token from now on (``RequestOutput.weight_versions``)."""
        return await self._control("control", "set_generation_epoch", "set_generation_epoch", {"epoch": int(epoch)})

    async def update_weights(self, path: str | None = None, version: int | None = None, method: str | None = None,
                             args: dict | None = None) -> dict:
        """``LLM.update_weights(path, version)`` on every engine, or the refit path's ``method``
        (``init_weight_transfer``, ``update_weights_from_distributed``, ``update_weights_from_ipc``,
        ``destroy_weight_transfer``, and a LoRA adapter's ``update_lora_from_distributed`` /
        ``update_lora_from_ipc`` with ``lora_name`` in ``args``: the engine's method of that name)
        with ``args``; ``args["engines"]``: only on those engines (indexes), e.g. each engine's
        ``init_weight_transfer`` with its own ``rank_offset``."""
        if method is None:
            return await self._control("control", "update_weights", "update_weights", {"path": path, "version": version})
        if method not in WEIGHT_TRANSFER_OPS:
            raise ValueError(f"method must be one of {WEIGHT_TRANSFER_OPS}, got {method!r}")
        return await self._control("control", method, method, dict(args or {}))

    async def load_lora_adapter(self, lora_name: str, lora_path: str, engines: Sequence[int] | None = None) -> dict:
        """Load the PEFT adapter at ``lora_path`` as ``lora_name`` on every engine, or on the engines
        ``engines`` names (indexes); requests naming it are routed among the engines holding it."""
        return await self.control("load_lora_adapter", _lora_args(lora_name, engines, lora_path=lora_path))

    async def unload_lora_adapter(self, lora_name: str, engines: Sequence[int] | None = None) -> dict:
        """Unload adapter ``lora_name`` from every engine (or those ``engines`` names); an engine
        whose unfinished requests use it refuses (409) and keeps it."""
        return await self.control("unload_lora_adapter", _lora_args(lora_name, engines))

    def adapters(self) -> list[str]:
        """The LoRA adapters some engine holds, as the coordinator last said."""
        return list((self.info or {}).get("loras", []))

    async def stop_engines(self) -> dict:
        """Every engine aborts its requests and leaves (the coordinator keeps running)."""
        return await self._control("control", "stop", "stop", {})

    async def drain_engine(self, index: int) -> dict:
        """Route nothing more to engine ``index``; returns once its requests ended and it left."""
        return await self._control("drain", "drain", int(index))

    async def engine_stats(self) -> dict:
        """Each engine's ``EngineStats`` counters, by index (``{"engines": {"0": {...}}}``)."""
        return await self._control("control", "stats", "stats", {})

    async def engines(self) -> dict:
        """The coordinator's engines (index, name, state, load, ...) and its counters."""
        return await self._control("engines", "engines")

    async def shutdown(self) -> dict:
        """Stop every engine, then the coordinator."""
        return await self._control("shutdown", "shutdown")

    # ---------------------------------------------------------------- from the coordinator (on the loop)
    def receive(self, kind: str, fields: Sequence[Any]) -> None:
        if kind == "stream":
            for upd in fields[0]:
                stream = self._streams.get(upd.request_id)
                if stream is not None:
                    stream.put(upd)
        elif kind == "finished":
            for out in fields[0]:
                self._end(out.request_id, out)
        elif kind == "rejected":
            self._end(fields[0], InvalidRequestError(fields[1]))
        elif kind == "control_done":
            op_id, status, body = fields
            entry = self._controls.pop(op_id, None)
            if entry is not None and not entry[1].done():
                entry[1].set_result((status, body))
        elif kind == "info":
            self.info = fields[0]

    def _end(self, rid: int, result: RequestOutput | BaseException) -> None:
        fut = self._futures.pop(rid, None)
        if fut is not None:
            if not fut.done():
                (fut.set_exception if isinstance(result, BaseException) else fut.set_result)(result)
            return
        stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.put(result)

    def coordinator_lost(self, reason: str) -> None:
        self.connection_lost(CoordinatorLost(reason))

    def connection_lost(self, error: BaseException) -> None:
        """Every open request and operation fails with ``error``; later calls raise it."""
        if self.lost is None:
            self.lost = error
        for rid in list(self._futures) + list(self._streams):
            self._end(rid, error)
        for _, done in self._controls.values():
            if not done.done():
                done.set_exception(error)
        self._controls.clear()


def _lora_args(lora_name: str, engines: Sequence[int] | None, **more) -> dict:
    args = {"lora_name": lora_name, **more}
    if engines is not None:
        args["engines"] = [int(i) for i in engines]
    return args
