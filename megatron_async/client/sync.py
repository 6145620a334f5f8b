"""``SyncInferenceClient``: ``InferenceClient`` from synchronous code (a trainer's loop, a
script). The client runs on an event loop of its own thread; every method hands its work to that
loop and waits for the answer.

    client = SyncInferenceClient("tcp://127.0.0.1:5555")
    outs = client.generate(prompts, SamplingParams(num_tokens_to_generate=32))
    client.pause_engines("keep"); client.update_weights(path=ckpt); client.set_generation_epoch(1)
    client.unpause_engines(); client.close()"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

from megatron_async.client.client import InferenceClient
from megatron_async.inference.request import InvalidRequestError, RequestOutput, SamplingParams


class SyncInferenceClient:
    def __init__(self, address: str, secret: bytes | str | None = None, tokenizer=None, timeout_s: float = 30.0):
        """Connects at once (``AuthError``: refused); arguments as ``InferenceClient``'s."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="megatron-async-client", daemon=True)
        self._thread.start()
        self.client = InferenceClient(address, secret, tokenizer, timeout_s)
        try:
            self._call(self.client.start())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _on_loop(self, fn, *args):
        async def run():
            return fn(*args)
        return self._call(run())

    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None
                    ) -> concurrent.futures.Future:
        """A future of the request's ``RequestOutput`` (``.result()`` waits)."""
        fut = self._on_loop(self.client.add_request, prompt, sampling_params)
        return asyncio.run_coroutine_threadsafe(_await(fut), self._loop)

    def add_group(self, prompt: str | Sequence[int], sampling_params: Sequence[SamplingParams]
                  ) -> list[concurrent.futures.Future]:
        """Requests of one prompt placed together (``InferenceClient.add_group``): a future each."""
        futures = self._on_loop(self.client.add_group, prompt, list(sampling_params))
        return [asyncio.run_coroutine_threadsafe(_await(f), self._loop) for f in futures]

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion through the engines; ``outs[i]`` belongs to ``prompts[i]``.
        A prompt the engine refuses gets an output with finish_reason "error" (as ``LLM.generate``)."""
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(prompts)

        async def run():
            futures = [self.client.add_request(p, sp) for p, sp in zip(prompts, params)]
            outs = await asyncio.gather(*(_await(f) for f in futures), return_exceptions=True)
            return [_as_output(f.request_id, p, o) for f, p, o in zip(futures, prompts, outs)]
        return self._call(run())

    def abort_request(self, request_id: int) -> None:
        self._on_loop(self.client.abort_request, request_id)

    def abort_all(self) -> None:
        self._on_loop(self.client.abort_all)

    def pause_engines(self, mode: str = "keep") -> dict:
        return self._call(self.client.pause_engines(mode))

    def unpause_engines(self) -> dict:
        return self._call(self.client.unpause_engines())

    def suspend_engines(self, tags: Sequence[str] = ("weights", "kv_cache"), keep_weights_on_host: bool = True) -> dict:
        return self._call(self.client.suspend_engines(tags, keep_weights_on_host))

    def resume_engines(self, tags: Sequence[str] = ("weights", "kv_cache")) -> dict:
        return self._call(self.client.resume_engines(tags))

    def set_generation_epoch(self, epoch: int) -> dict:
        return self._call(self.client.set_generation_epoch(epoch))

    def update_weights(self, path: str | None = None, version: int | None = None, method: str | None = None,
                       args: dict | None = None) -> dict:
        return self._call(self.client.update_weights(path, version, method, args))

    def load_lora_adapter(self, lora_name: str, lora_path: str, engines: Sequence[int] | None = None) -> dict:
        return self._call(self.client.load_lora_adapter(lora_name, lora_path, engines))

    def unload_lora_adapter(self, lora_name: str, engines: Sequence[int] | None = None) -> dict:
        return self._call(self.client.unload_lora_adapter(lora_name, engines))

    def stop_engines(self) -> dict:
        return self._call(self.client.stop_engines())

    def drain_engine(self, index: int) -> dict:
        return self._call(self.client.drain_engine(index))

    def engine_stats(self) -> dict:
        return self._call(self.client.engine_stats())

    def engines(self) -> dict:
        return self._call(self.client.engines())

    def shutdown(self) -> dict:
        return self._call(self.client.shutdown())

    def close(self) -> None:
        if self._thread.is_alive():
            self._on_loop(self.client.close)
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> SyncInferenceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _await(fut) -> Any:
    return await fut


def _as_output(rid: int, prompt, result) -> RequestOutput:
    if isinstance(result, InvalidRequestError):
        tokens = [] if isinstance(prompt, str) else list(prompt)
        return RequestOutput(rid, tokens, [], None, "error", error=str(result))
    if isinstance(result, BaseException):
        raise result
    return result
