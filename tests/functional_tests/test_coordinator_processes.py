"""Engines behind a coordinator as separate processes, a client in this one: an engine killed
mid-generation loses no request (each ends exactly once: completed, routed again, or "error"
with its partial output), nothing hangs, a client that disappears has its requests aborted and
their KV freed, an engine that joins late takes work at once, a drained one leaves."""
from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from collections import Counter

import pytest

from megatron_async import SamplingParams
from megatron_async.client import InferenceClient
from tests.helpers.coordinator_procs import ROOT, Cluster, _env

TOKENS = 48
ENGINE = ("--max-requests", "4", "--block-size", "8", "--num-kv-blocks", "256", "--prefix-caching")
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster("load_balanced")
    try:
        for i in range(3):
            c.start_engine(f"e{i}", *ENGINE)
        c.index = {f"e{i}": c.wait_engine(f"e{i}") for i in range(3)}
        yield c
    finally:
        c.close()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(rng.randrange(6, 20))] for _ in range(n)]


class Counting(InferenceClient):
    """Counts the final outputs the coordinator sends for each request."""

    def receive(self, kind, fields):
        if kind == "finished":
            self.ends.update(o.request_id for o in fields[0])
        super().receive(kind, fields)


async def engines(client):
    return await asyncio.wait_for(client.engines(), 10)


def test_an_engine_killed_mid_generation_loses_no_request(cluster):
    from megatron_async import LLM, InferenceConfig

    ps = prompts(24, seed=1)
    ref = LLM(None, "cpu", "float32", InferenceConfig(block_size_tokens=8, max_requests=24, num_kv_blocks=256))
    reference = [o.generated_tokens for o in ref.generate(ps, GREEDY)]

    async def run():
        client = Counting(cluster.address)
        client.ends = Counter()
        await client.start()
        streams = [client.add_request_streaming(p, GREEDY) for p in ps]
        seen = {s.request_id: [] for s in streams}
        victim = cluster.engines["e0"]

        async def follow(stream):
            async for upd in stream:
                seen[stream.request_id] += upd.new_tokens
            return stream.output

        tasks = [asyncio.ensure_future(follow(s)) for s in streams]
        before = (await engines(client))["engines"]
        assert [e["submitted"] for e in before] == [8, 8, 8]  # 4 running + 4 queued on each
        # load_balanced, ties to the lowest index: request k went to engine k % 3, so each engine's
        # running requests are known; kill once each engine has streamed tokens (under load one
        # engine may start late, and a victim with no tokens would only re-route)
        def generating(index: int) -> bool:
            return any(seen[s.request_id] for s in streams[index::3])

        while not all(generating(i) for i in range(3)):
            await asyncio.sleep(0.01)
        victim.kill()
        killed_at = time.monotonic()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        first_error = time.monotonic() - killed_at
        counts = (await engines(client))["counts"]
        client.close()
        return outs, seen, counts, client.ends, first_error

    outs, seen, counts, ends, waited = asyncio.run(run())
    assert sorted(ends.values()) == [1] * 24  # every request ended exactly once
    errors = [o for o in outs if o.finish_reason == "error"]
    assert errors and counts["failed_by_death"] == len(errors) and counts["rerouted"] >= 1
    for o in errors:  # the partial output is exactly what it streamed, and said why
        assert 0 < len(o.generated_tokens) < TOKENS and o.generated_tokens == seen[o.request_id]
        assert "died" in o.error
    for i, o in enumerate(outs):
        if o.finish_reason != "error":
            assert o.finish_reason == "length" and o.generated_tokens == reference[i]  # re-routed ones too
            assert seen[o.request_id] == o.generated_tokens  # streamed once: nothing repeated by a re-route
    assert waited < 60


def test_an_engine_killed_mid_generation_ends_its_directly_answered_requests(cluster):
    """Non-streaming requests, whose outputs engines send the client themselves: the killed
    engine's requests end with "error" (its partial output, kept from its updates) or run again,
    each exactly once, while the others' outputs came from their engines directly."""
    victim = cluster.add_engine("victim", *ENGINE)
    ps = prompts(12, seed=3)

    async def run():
        client = Counting(cluster.address)
        client.ends = Counter()
        await client.start()
        futures = [client.add_request(p, GREEDY) for p in ps]
        while True:  # until the victim generated (its requests have tokens to end with)
            stats = await asyncio.wait_for(client.engine_stats(), 10)
            if stats["engines"][str(victim)]["generated_tokens"] > 0:
                break
        cluster.engines["victim"].kill()
        outs = await asyncio.wait_for(asyncio.gather(*futures), 120)
        direct = client._channel.replies.received
        # an engine tells the coordinator what it delivered on its next update, which can come
        # after the client already holds the reply
        deadline = time.monotonic() + 10
        while True:
            counts = (await engines(client))["counts"]
            if counts.get("delivered_directly", 0) > 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        client.close()
        return outs, counts, client.ends, direct

    outs, counts, ends, direct = asyncio.run(run())
    assert sorted(ends.values()) == [1] * 12  # every request ended exactly once, whichever way
    errors = [o for o in outs if o.finish_reason == "error"]
    assert errors and all("died" in o.error and 0 < len(o.generated_tokens) < TOKENS for o in errors)
    assert all(len(o.generated_tokens) == TOKENS for o in outs if o.finish_reason == "length")
    assert len(errors) + sum(o.finish_reason == "length" for o in outs) == 12
    assert direct > 0 and counts.get("delivered_directly", 0) > 0  # the other engines answered directly


def test_a_client_that_disappears_has_its_requests_aborted_and_their_kv_freed(cluster):
    code = (
        "import asyncio, sys, os\n"
        "from megatron_async import SamplingParams\n"
        "from megatron_async.client import InferenceClient\n"
        "async def main():\n"
        "    c = await InferenceClient(sys.argv[1]).start()\n"
        "    sp = SamplingParams(top_k=1, num_tokens_to_generate=2000, ignore_eos=True)\n"
        "    streams = [c.add_request_streaming([7, 8, 9, i + 10] * 4, sp) for i in range(6)]\n"
        "    quiet = [c.add_request([6, 5, i + 10] * 4, sp) for i in range(3)]  # answered directly\n"
        "    async for _ in streams[0]:\n"
        "        break\n"
        "    print('generating', flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", code, cluster.address], stdout=subprocess.PIPE, text=True,
                            env=_env(), cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "generating"
        before = {}

        async def check():
            client = await InferenceClient(cluster.address).start()
            listing = await engines(client)
            busy = [e for e in listing["engines"] if e["load"]]
            assert busy  # its requests run
            before["aborted"] = listing["counts"].get("aborted_for_client", 0)  # (the module's other clients')
            proc.kill()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                listing = await engines(client)
                live = listing["engines"]
                if all(e["load"] == 0 and e["free_blocks"] == e["capacity_blocks"] for e in live):
                    break
                await asyncio.sleep(0.2)
            client.close()
            return listing

        listing = asyncio.run(check())
        assert all(e["load"] == 0 and e["free_blocks"] == e["capacity_blocks"] for e in listing["engines"]), listing
        assert listing["counts"]["aborted_for_client"] - before["aborted"] == 9
    finally:
        proc.kill()
        proc.wait(10)


def test_an_engine_that_joins_takes_work_at_once_and_a_drained_one_leaves(cluster):
    late = cluster.add_engine("late", *ENGINE)

    async def run():
        client = await InferenceClient(cluster.address).start()
        futures = [client.add_request(p, GREEDY) for p in prompts(12, seed=2)]
        listing = await engines(client)
        took = {e["index"]: e["submitted"] for e in listing["engines"]}
        drained = asyncio.ensure_future(asyncio.wait_for(client.drain_engine(late), 60))
        outs = await asyncio.wait_for(asyncio.gather(*futures), 120)
        answer = await drained
        after = await engines(client)
        client.close()
        return took, outs, answer, after

    took, outs, answer, after = asyncio.run(run())
    assert took[late] >= 3  # the least loaded engine got its share at once
    assert all(o.finish_reason == "length" and len(o.generated_tokens) == TOKENS for o in outs)
    assert answer == {"index": late, "left": True, "died": False}
    assert late not in {e["index"] for e in after["engines"]}
    assert cluster.engines["late"].wait(30) == 0  # it left and its process ended by itself
