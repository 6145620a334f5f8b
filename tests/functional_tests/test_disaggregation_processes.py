"""Prefill / decode disaggregation as separate processes (``serve --join ADDR --role prefill |
decode``, gloo KV transfers on the CPU, and ipc), a client in this one: the tokens of 1 prefill +
1 decode engine equal one colocated engine's (greedy and seeded sampling; a hybrid model's Mamba
state travels too), the decode engine never computes a prompt, streaming and aborts across the
hand-off, and a killed decode or prefill engine ends every request exactly once with its blocks
freed on the engines that remain (with no decode engine left, the prefill engine decodes)."""
from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.client import InferenceClient
from tests.helpers.coordinator_procs import Cluster

ENGINE = ("--max-requests", "4", "--block-size", "8", "--num-kv-blocks", "256", "--prefix-caching")
DEADLINE_S = 240.0


def prompts(n: int, seed: int, lo: int = 6, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def reference(ps, params) -> list[list[int]]:
    llm = LLM(None, "cpu", "float32", InferenceConfig(block_size_tokens=8, max_requests=16, num_kv_blocks=512))
    return [o.generated_tokens for o in llm.generate(ps, params)]


class Counting(InferenceClient):
    """Counts the final outputs the coordinator sends for each request."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ends: Counter = Counter()

    def receive(self, kind, fields):
        if kind == "finished":
            self.ends.update(o.request_id for o in fields[0])
        super().receive(kind, fields)


async def until(check, timeout_s: float = 60.0, every_s: float = 0.05):
    """Polls the coroutine ``check()`` until it returns a truthy value (that value)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if value := await check():
            return value
        await asyncio.sleep(every_s)
    raise AssertionError("the awaited state never came")


def by_role(engines: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for e in engines["engines"]:
        out.setdefault(e["role"], []).append(e)
    return out


async def all_freed(client) -> bool:
    """Every live engine holds no request and no block (its free blocks include cached ones)."""
    engines = (await client.engines())["engines"]
    return all(e["pending"] == 0 and e["free_blocks"] == e["capacity_blocks"] for e in engines)


@pytest.fixture(scope="module")
def pair():
    c = Cluster("load_balanced")
    try:
        c.start_engine("p0", *ENGINE, "--role", "prefill")
        c.start_engine("d0", *ENGINE, "--role", "decode")
        c.index = {name: c.wait_engine(name) for name in ("p0", "d0")}
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("params", [SamplingParams(top_k=1, num_tokens_to_generate=24, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=7, num_tokens_to_generate=24,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_tokens_equal_one_colocated_engine(pair, params):
    ps = prompts(8, seed=3)
    want = reference(ps, params)

    async def run():
        async with InferenceClient(pair.address) as client:
            outs = await asyncio.wait_for(asyncio.gather(*[client.add_request(p, params) for p in ps]), DEADLINE_S)
            assert [o.generated_tokens for o in outs] == want
            assert {o.finish_reason for o in outs} == {"length"}
            roles = by_role(await client.engines())
            assert roles["prefill"][0]["kv_sent_blocks"] > 0 and roles["decode"][0]["kv_received_blocks"] > 0
            stats = (await client.engine_stats())["engines"]
            decode, prefill = stats[str(pair.index["d0"])], stats[str(pair.index["p0"])]
            assert decode["prefill_steps"] == 0 and decode["decode_steps"] > 0
            assert decode["kv_received_blocks"] > 0 and prefill["kv_sent_blocks"] > 0
            await until(lambda: all_freed(client))

    asyncio.run(run())


def test_streaming_across_the_hand_off(pair):
    params = SamplingParams(top_k=1, num_tokens_to_generate=20, ignore_eos=True)
    ps = prompts(4, seed=5)
    want = reference(ps, params)

    async def run():
        async with InferenceClient(pair.address) as client:
            async def follow(stream):
                updates = [upd async for upd in stream]
                return updates, stream.output

            results = await asyncio.wait_for(asyncio.gather(
                *[follow(client.add_request_streaming(p, params)) for p in ps]), DEADLINE_S)
            for (updates, output), tokens in zip(results, want):
                assert list(updates[0].new_tokens) == tokens[:1]  # the prefill engine's first token
                assert [t for u in updates for t in u.new_tokens] == tokens == output.generated_tokens
                assert [u.finished for u in updates] == [False] * (len(updates) - 1) + [True]

    asyncio.run(run())


def test_aborts_across_the_hand_off_free_both_engines(pair):
    params = SamplingParams(top_k=1, num_tokens_to_generate=400, ignore_eos=True)
    ps = prompts(6, seed=9)

    async def run():
        client = Counting(pair.address)
        await client.start()
        try:
            streams = [client.add_request_streaming(p, params) for p in ps]

            async def abort_after(stream, n: int):
                seen = 0
                async for upd in stream:
                    seen += len(upd.new_tokens)
                    if seen >= n and not upd.finished:
                        client.abort_request(stream.request_id)
                return stream.output

            # at the first token (the request is in transfer or just imported) and later (decoding)
            outs = await asyncio.wait_for(asyncio.gather(
                *[abort_after(s, 1 if i % 2 else 3) for i, s in enumerate(streams)]), DEADLINE_S)
            assert {o.finish_reason for o in outs} == {"abort"}
            await until(lambda: all_freed(client))
            assert all(client.ends[s.request_id] == 1 for s in streams)
        finally:
            client.close()

    asyncio.run(run())


def test_when_the_only_decode_engine_dies_the_prefill_engine_decodes(pair):
    """Transfers left without a decode engine are decoded by their prefill engine (the blocks it
    kept); requests that were decoding on the dead engine end with "error" and their partial output.
    The last test of the pair (its decode engine is gone after it): no cluster of its own to start."""
    _kill_mid_generation(pair, "d0", "decode", seed=13)


@pytest.fixture(scope="module")
def four():
    c = Cluster("load_balanced")
    try:
        for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
            c.start_engine(name, *ENGINE, "--role", role)
        c.index = {name: c.wait_engine(name) for name in ("p0", "p1", "d0", "d1")}
        yield c
    finally:
        c.close()


def _check_ends(client, streams, outs, want) -> Counter:
    reasons = Counter()
    for stream, out, tokens in zip(streams, outs, want):
        assert client.ends[stream.request_id] == 1
        reasons[out.finish_reason] += 1
        if out.finish_reason == "length":
            assert out.generated_tokens == tokens
        else:
            assert out.finish_reason == "error" and "engine" in out.error
            assert out.generated_tokens == tokens[:len(out.generated_tokens)]
    return reasons


def _kill_mid_generation(cluster, victim: str, role: str, seed: int) -> None:
    params = SamplingParams(top_k=1, num_tokens_to_generate=48, ignore_eos=True)
    ps = prompts(12, seed=seed, lo=20, hi=60)
    want = reference(ps, params)

    async def run():
        client = Counting(cluster.address)
        await client.start()
        try:
            before = (await client.engines())["counts"]  # (a cluster earlier tests used: what this one adds)
            streams = [client.add_request_streaming(p, params) for p in ps]
            streamed = Counter()

            async def follow(stream):
                async for upd in stream:
                    streamed[stream.request_id] += len(upd.new_tokens)
                return stream.output

            tasks = [asyncio.ensure_future(follow(s)) for s in streams]
            index = cluster.index[victim]

            async def victim_busy():
                mine = [e for e in (await client.engines())["engines"] if e["index"] == index]
                return mine and mine[0]["pending"] > 0 and any(n >= 2 for n in streamed.values())

            await until(victim_busy, DEADLINE_S, 0.01)
            cluster.engines[victim].kill()
            outs = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
            _check_ends(client, streams, outs, want)
            info = await client.engines()
            assert index not in [e["index"] for e in info["engines"]]
            counts = info["counts"]
            moved = sum(counts.get(k, 0) - before.get(k, 0) for k in ("kv_replaced", "failed_by_death", "rerouted"))
            assert moved > 0, (before, counts)
            await until(lambda: all_freed(client))
            # the engines that remain serve on
            outs = await asyncio.wait_for(asyncio.gather(*[client.add_request(p, params) for p in ps[:4]]), DEADLINE_S)
            assert [o.generated_tokens for o in outs] == want[:4]
        finally:
            client.close()

    asyncio.run(run())


def test_a_killed_decode_engine_ends_every_request_once(four):
    _kill_mid_generation(four, "d0", "decode", seed=11)


def test_a_killed_prefill_engine_ends_every_request_once(four):
    _kill_mid_generation(four, "p0", "prefill", seed=12)


def test_ipc_pairs_share_blocks_between_processes():
    """``--kv-transfer-backend ipc`` on the CPU: the blocks in shared memory the decode process maps."""
    params = SamplingParams(top_k=1, num_tokens_to_generate=16, ignore_eos=True)
    ps = prompts(4, seed=21)
    want = reference(ps, params)
    c = Cluster("load_balanced")
    try:
        c.start_engine("p", *ENGINE, "--role", "prefill", "--kv-transfer-backend", "ipc")
        c.start_engine("d", *ENGINE, "--role", "decode", "--kv-transfer-backend", "ipc")
        for name in ("p", "d"):
            c.wait_engine(name)

        async def run():
            async with InferenceClient(c.address) as client:
                outs = await asyncio.wait_for(asyncio.gather(*[client.add_request(p, params) for p in ps]), DEADLINE_S)
                assert [o.generated_tokens for o in outs] == want
                roles = by_role(await client.engines())
                assert roles["decode"][0]["kv_received_blocks"] > 0
                await until(lambda: all_freed(client))

        asyncio.run(run())
    finally:
        c.close()


def test_a_hybrid_models_mamba_state_travels_with_its_blocks(tmp_path):
    from tests.helpers.engine_harness import make_llm
    from tests.helpers.hf_hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_checkpoint

    path = str(make_tiny_hybrid_checkpoint(HYBRID_ARCHS[0], tmp_path / "hybrid"))
    params = SamplingParams(temperature=0.8, seed=3, num_tokens_to_generate=16, ignore_eos=True)
    ps = [[t % 127 + 1 for t in p] for p in prompts(4, seed=23)]  # (its vocabulary: 128)
    want = [o.generated_tokens for o in make_llm(path, max_requests=4, block_size_tokens=8).generate(ps, params)]
    model = ("--model", path, "--device", "cpu", "--dtype", "float32")
    flags = ("--max-requests", "4", "--block-size", "8", "--num-kv-blocks", "256")
    c = Cluster("load_balanced")
    try:
        c.start_engine("p", *flags, "--role", "prefill", model=model)
        c.start_engine("d", *flags, "--role", "decode", model=model)
        c.index = {name: c.wait_engine(name) for name in ("p", "d")}

        async def run():
            async with InferenceClient(c.address) as client:
                outs = await asyncio.wait_for(asyncio.gather(*[client.add_request(p, params) for p in ps]), DEADLINE_S)
                assert [o.generated_tokens for o in outs] == want
                stats = (await client.engine_stats())["engines"]
                decode = stats[str(c.index["d"])]
                assert decode["prefill_steps"] == 0 and decode["kv_received_blocks"] > 0

        asyncio.run(run())
    finally:
        c.close()
