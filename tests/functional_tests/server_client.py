"""Client-side helpers of the server tests (the official openai client over loopback)."""
import asyncio
import json
import urllib.error
import urllib.request

import openai


def json_request(url: str, body: dict | bytes | None = None, timeout: float = 60) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of a POST of ``body`` (a dict as JSON, or raw bytes) to ``url``, or of
    a GET where there is no body; an error status comes back with its JSON body, not raised."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def concurrent_greedy_streams(url: str, model: str, prompts: list, max_tokens: int,
                              bad_bodies: tuple[dict, ...] = ()) -> list[list[int]]:
    """Stream one greedy completion per prompt, all at once; the token ids each stream carried.
    ``bad_bodies`` (completion kwargs) are sent among them, and each must get HTTP 400."""

    async def one(client, prompt):
        ids = []
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            ids += (chunk.choices[0].model_extra.get("token_ids") or []) if chunk.choices else []
        return ids

    async def bad(client, body):
        await asyncio.sleep(0.05)  # while the streams run
        try:
            await client.completions.create(model=model, **body)
        except openai.BadRequestError:
            return
        raise AssertionError(f"no 400 for {body}")

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            results = await asyncio.gather(*(one(client, p) for p in prompts), *(bad(client, b) for b in bad_bodies))
            return results[: len(prompts)]
        finally:
            await client.close()

    return asyncio.run(main())
