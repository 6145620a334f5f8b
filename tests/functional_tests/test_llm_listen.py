"""``LLM(..., listen=ADDR)`` starts a coordinator and serves its engine through it;
``LLM(..., join=ADDR)`` adds another engine; a client reaches both; ``close()`` lets each engine
leave and stops the coordinator it started. The coordinator started so (and by ``serve
--listen``) takes its engine timeout from the engine job's settings."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.client import InferenceClient
from megatron_async.coordinator.engines import EngineInfo
from megatron_async.coordinator.transport import PeerSocket
from megatron_async.coordinator.trust import ENV_SECRET, peer_secret
from tests.helpers.coordinator_procs import ROOT, TINY_ENGINE, _env, _wait_line

ENGINE_TIMEOUT_S = 2.0
"""Far below the default (30 s): a coordinator that did not get the setting keeps a silent engine."""


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


@pytest.fixture
def own_secrets(monkeypatch, tmp_path):
    """The coordinators' same-user secret files (trust.secret_file) under this test's directory."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv(ENV_SECRET, raising=False)


def silent_engine_declared_dead_after(address: str) -> float:
    """An engine (4-token blocks, as the job's) registers at ``address``, then sends nothing: seconds from its
    register until the coordinator tells it it was declared dead (``rejected`` -1). From the send, not from the
    coordinator's answer: on a loaded host the answer is read late, and the silence then looked shorter than it was."""
    p = PeerSocket(address, peer_secret(address), "engine", "silent", 10)
    try:
        sent_at = time.monotonic()  # the coordinator last heard the engine after this (its register)
        p.send("register", EngineInfo("silent", 8, 100, 4, b"k", True))
        deadline, registered = sent_at + 4 * ENGINE_TIMEOUT_S + 10, False
        while time.monotonic() < deadline:
            p.wait(0.05)
            for kind, fields in p.take():
                if kind == "info":
                    registered = True
                elif kind == "rejected":
                    assert registered and fields[0] == -1, fields  # not refused at registration
                    return time.monotonic() - sent_at
        raise AssertionError(f"the silent engine was not declared dead within {4 * ENGINE_TIMEOUT_S + 10} s")
    finally:
        p.close()


def assert_declared_dead_in_time(address: str) -> None:
    """Within the timeout plus the coordinator's once-a-second check and a loaded machine's slack;
    the engine job's own engine keeps beating and stays."""
    assert ENGINE_TIMEOUT_S < silent_engine_declared_dead_after(address) < ENGINE_TIMEOUT_S + 3.0

    async def listing():
        client = await InferenceClient(address).start()
        try:
            return await client.engines()
        finally:
            client.close()

    got = asyncio.run(listing())
    assert got["counts"]["timed_out"] == 1
    assert [(e["index"], e["state"]) for e in got["engines"]] == [(0, "active")]  # "silent" was engine 1


def test_llm_listen_passes_the_engine_timeout_to_its_coordinator(own_secrets):
    cfg = InferenceConfig(block_size_tokens=4, num_kv_blocks=64, max_requests=4, dp_engine_timeout_s=ENGINE_TIMEOUT_S)
    llm = LLM(None, "cpu", inference_config=cfg, listen="tcp://127.0.0.1:0")
    try:
        assert_declared_dead_in_time(llm.coordinator.address)
    finally:
        llm.close()


def test_serve_listen_passes_the_engine_timeout_to_its_coordinator(own_secrets):
    proc = subprocess.Popen([sys.executable, "-m", "megatron_async.serve", "--listen", "tcp://127.0.0.1:0",
                             "--engine-timeout-s", str(ENGINE_TIMEOUT_S), "--block-size", "4", *TINY_ENGINE],
                            stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        address = _wait_line(proc, "megatron_async.serve: engine ", 120).split()[-1]
        assert_declared_dead_in_time(address)
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
