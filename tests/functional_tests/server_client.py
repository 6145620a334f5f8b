"""Client-side helpers of the server tests (the official openai client over loopback)."""
import asyncio

import openai


def concurrent_greedy_streams(url: str, model: str, prompts: list, max_tokens: int) -> list[list[int]]:
    """Stream one greedy completion per prompt, all at once; the token ids each stream carried."""

    async def one(client, prompt):
        ids = []
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            ids += (chunk.choices[0].model_extra.get("token_ids") or []) if chunk.choices else []
        return ids

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    return asyncio.run(main())
