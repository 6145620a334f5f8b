"""The two HTTP clients of the load test (benchmarks/server_load.py), behind one small interface:
``served_model()``, ``chunks(body)`` (an async generator of one streamed completion's chunks, each
as ``(response id, [(token ids, finish reason) per choice])``; closing it early closes the HTTP
stream, which the server takes as a disconnect) and ``close()``.

``openai``: the official client, as users drive the server; it validates every SSE chunk into
pydantic models (about twice the raw client's CPU per chunk: docs/PERFORMANCE.md, "Serving"). ``raw``: the same request
body over a streaming POST with ``httpx2`` (the HTTP library the openai client is built on), each
``data:`` line parsed with ``json.loads``: the lighter load generator, to show whether the
client bounds a server measurement."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

Chunk = tuple[str, list[tuple[list[int], "str | None"]]]
"""One SSE chunk: the response id and, per choice, its token ids and finish reason."""

CLIENTS = ("openai", "raw")
_OPENAI_ARGS = ("model", "prompt", "max_tokens", "temperature", "stream")
"""Body fields that ``completions.create`` takes by name; the rest go in its ``extra_body``."""


class OpenAIStreams:
    def __init__(self, base_url: str, timeout_s: float):
        import openai

        self._client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                          timeout=timeout_s)

    async def served_model(self) -> str:
        return (await self._client.models.list()).data[0].id

    async def chunks(self, body: dict) -> AsyncIterator[Chunk]:
        stream = await self._client.completions.create(
            **{k: v for k, v in body.items() if k in _OPENAI_ARGS},
            extra_body={k: v for k, v in body.items() if k not in _OPENAI_ARGS})
        try:
            async for chunk in stream:
                yield chunk.id, [((c.model_extra or {}).get("token_ids") or [], c.finish_reason)
                                 for c in chunk.choices]
        finally:
            await stream.close()

    async def close(self) -> None:
        await self._client.close()


class RawStreams:
    def __init__(self, base_url: str, timeout_s: float):
        import httpx2

        # the openai client's own connection limits, so that only the per-chunk work differs
        self._http = httpx2.AsyncClient(base_url=base_url, timeout=httpx2.Timeout(timeout_s),
                                        limits=httpx2.Limits(max_connections=1000, max_keepalive_connections=100))

    async def served_model(self) -> str:
        r = await self._http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    async def chunks(self, body: dict) -> AsyncIterator[Chunk]:
        async with self._http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            done = False
            async for line in r.aiter_lines():  # read to the end after [DONE]: the connection is reused
                if done or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data.startswith("[DONE]"):
                    done = True
                    continue
                obj = json.loads(data)
                if obj.get("error"):
                    raise RuntimeError(f"error in stream: {obj['error']}")
                yield obj["id"], [(c.get("token_ids") or [], c.get("finish_reason")) for c in obj["choices"]]

    async def close(self) -> None:
        await self._http.aclose()


def make_client(kind: str, base_url: str, timeout_s: float) -> OpenAIStreams | RawStreams:
    if kind not in CLIENTS:
        raise ValueError(f"client must be one of {CLIENTS}, not {kind!r}")
    return (OpenAIStreams if kind == "openai" else RawStreams)(base_url, timeout_s)
