"""An adapter refit through a data-parallel coordinator while one of its requests streams (the RL
loop of a LoRA trainer): two engines (processes of their own) join the trainer's gloo transfer
group, each at its own rank (a control operation sent to one engine), and take the adapter's new
weights, Megatron-Core TP shards broadcast by the trainer, as one control operation on both; the
streaming request goes on across the update, and its tokens are those of an engine whose adapter
was rewritten at the same token (the weight versions say which)."""
from __future__ import annotations

import asyncio
import threading

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.client import InferenceClient
from megatron_async.weight_transfer import Shard, build_manifest, free_port, init_transfer_group, send
from tests.helpers.coordinator_procs import Cluster
from tests.helpers.lora_adapters import megatron_shards, peft_named, random_modules, write_random_adapter

NEW = 64
PROMPT = [5, 17, 99, 3, 42, 7]
LORA = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
CONFIG = dict(enable_lora=True, max_loras=2, max_lora_rank=8, block_size_tokens=8, max_requests=8, num_kv_blocks=128)


def _greedy() -> SamplingParams:
    return SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True, lora="a")


def _reference(path, second: dict, switch: int) -> list[int]:
    """The first ``switch`` tokens with the adapter's first weights, the rest with its second."""
    llm = LLM(None, "cpu", "float32", InferenceConfig(async_scheduling=False, **CONFIG))
    llm.load_lora("a", str(path))
    rid, generated = llm.engine.add_request(PROMPT, _greedy()), 0
    while generated < switch:  # (serial steps: each lands what it launched)
        generated += sum(len(u.new_tokens) for u in llm.engine.step().updates if u.request_id == rid)
    llm.update_lora("a", peft_named(second))
    return {o.request_id: o for o in llm.engine.run_until_done()}[rid].generated_tokens


def test_adapter_refit_through_the_coordinator_while_a_request_streams(tmp_path):
    shapes = LLM(None, "cpu", "float32", InferenceConfig(**CONFIG))
    path = write_random_adapter(shapes.engine.context.lora, tmp_path / "a", 4, 8, seed=1)
    second = random_modules(shapes, False, seed=2)
    items = [(n, t, Shard(r, 2)) for r, s in enumerate(megatron_shards(shapes, second, False, 2)) for n, t in s.items()]
    manifest = build_manifest(items, 4 << 10, weights_format="megatron")
    cluster = Cluster("load_balanced")
    try:
        for name in ("e0", "e1"):
            cluster.start_engine(name, "--max-requests", "4", "--block-size", "8", "--num-kv-blocks", "128", *LORA,
                                 "--lora-modules", f"a={path}")
        indexes = [cluster.wait_engine(name) for name in ("e0", "e1")]

        async def run():
            client = InferenceClient(cluster.address)
            await client.start()
            port, sent = free_port(), []
            trainer = threading.Thread(target=lambda: sent.append(send(
                init_transfer_group("127.0.0.1", port, 0, 3, "gloo", timeout_s=60), manifest, items)))
            trainer.start()
            joined = await asyncio.gather(*(client.update_weights(method="init_weight_transfer", args={
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1 + i, "world_size": 3,
                "engines": [index]}) for i, index in enumerate(indexes)))
            assert [list(j["engines"]) for j in joined] == [[str(i)] for i in indexes]  # each its own rank
            stream = client.add_request_streaming(PROMPT, _greedy())
            seen, answer = [], None
            async for upd in stream:
                seen += upd.new_tokens
                if answer is None and len(seen) >= 4:  # mid-generation: the update while it streams
                    answer = asyncio.ensure_future(client.update_weights(
                        method="update_lora_from_distributed", args={"lora_name": "a", "metadata": manifest.to_json()}))
            body = await asyncio.wait_for(answer, 60)
            trainer.join(60)
            client.close()
            return stream.output, body, sent

        out, body, sent = asyncio.run(asyncio.wait_for(run(), 180))
    finally:
        cluster.close()
    assert sent == [None] and [e["weight_version"] for e in body["engines"].values()] == [1, 1]  # both engines
    versions = out.weight_versions
    switch = versions.index(1)
    assert 4 <= switch < NEW and versions == [0] * switch + [1] * (NEW - switch)  # went on across the update
    assert out.generated_tokens == _reference(path, second, switch)
