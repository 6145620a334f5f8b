"""``LLM(..., listen=ADDR)`` starts a coordinator and serves its engine through it;
``LLM(..., join=ADDR)`` adds another engine; a client reaches both; ``close()`` lets each engine
leave and stops the coordinator it started."""
from __future__ import annotations

import asyncio

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.client import InferenceClient


def test_llm_listen_and_join():
    cfg = InferenceConfig(block_size_tokens=4, num_kv_blocks=128, max_requests=4, enable_prefix_caching=True)
    first = LLM(None, "cpu", inference_config=cfg, listen="tcp://127.0.0.1:0")
    second = LLM(None, "cpu", inference_config=cfg, join=first.coordinator.address)
    try:
        assert (first.coordinator.index, second.coordinator.index) == (0, 1)
        params = SamplingParams(top_k=1, num_tokens_to_generate=5)
        prompts = [[i, i + 1, i + 2] for i in range(1, 9)]
        want = [o.generated_tokens for o in LLM(None, "cpu", inference_config=cfg).generate(prompts, params)]

        async def run():
            client = await InferenceClient(first.coordinator.address).start()
            outs = await asyncio.wait_for(asyncio.gather(*(client.add_request(p, params) for p in prompts)), 120)
            listing = await client.engines()
            client.close()
            return outs, listing

        outs, listing = asyncio.run(run())
        assert [o.generated_tokens for o in outs] == want
        assert [e["submitted"] for e in listing["engines"]] == [4, 4]
    finally:
        second.close()
        process = first.coordinator.process
        first.close()
    assert process.poll() is not None
