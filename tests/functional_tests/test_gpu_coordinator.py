"""Two engines behind a coordinator on GPUs (two engine processes sharing one GPU, each given its
share by ``--gpu-memory-utilization``; or one GPU each where a machine has two), batch-invariant,
bf16, the qwen3-0.6b shape: the same requests through the client, and through the OpenAI server
over the client, give one engine's tokens (and through the client its log-probs), bit for bit,
whichever engine each request lands on and whatever shares its steps.

    python -m pytest -q -m "gpu or multigpu" tests/functional_tests/test_gpu_coordinator.py

A few minutes on an H100 (two engine start-ups with Triton builds; no CUDA graph warm-up)."""
from __future__ import annotations

import asyncio
import gc
import json
import random
import urllib.request

import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.client import InferenceClient
from benchmarks.commands.disagg import own_gpu_first
from tests.helpers.coordinator_procs import Cluster

VOCAB = 151936
MODEL = ("--default-model", "qwen3-0.6b", "--device", "cuda", "--dtype", "bfloat16")
ENGINE = ("--batch-invariant", "--prefix-caching", "--max-requests", "64", "--max-tokens", "2048",
          "--max-sequence-length", "4096", "--no-warmup", "--eager")


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """48 requests: a third share one of two 600-token heads (prefix hits, affinity), half greedy,
    half sampled with seeds, all with log-probs."""
    rng = random.Random(0)
    heads = [[rng.randrange(VOCAB) for _ in range(600)] for _ in range(2)]
    prompts, params = [], []
    for i in range(48):
        own = [rng.randrange(VOCAB) for _ in range(rng.randint(50, 400))]
        prompts.append(heads[i % 2] + own if i % 3 == 0 else own)
        n = rng.randint(16, 48)
        params.append(SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True, return_log_probs=True)
                      if i % 2 else SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, num_tokens_to_generate=n,
                                                   ignore_eos=True, return_log_probs=True))
    return prompts, params


@pytest.fixture(scope="module")
def reference():
    prompts, params = workload()
    llm = LLM(None, "cuda", "bfloat16", InferenceConfig(max_requests=64, max_tokens=2048, max_sequence_length=4096,
                                                         buffer_size_gb=4.0, batch_invariant=True, cuda_graphs=False),
              default_model="qwen3-0.6b")
    outs = [(o.generated_tokens, o.generated_log_probs) for o in llm.generate(prompts, params)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs


def layouts():
    yield pytest.param("shared", marks=pytest.mark.gpu, id="two-engines-one-gpu")
    yield pytest.param("split", marks=pytest.mark.multigpu, id="one-gpu-each")


@pytest.fixture(scope="module", params=list(layouts()))
def cluster(request):
    c = Cluster("longest_prefix", timeout_s=400)
    try:
        if request.param == "shared":  # each its share of one GPU: the second counts the first's memory as taken
            c.add_engine("e0", *ENGINE, "--gpu-memory-utilization", "0.4", model=MODEL)
            c.add_engine("e1", *ENGINE, "--gpu-memory-utilization", "0.8", model=MODEL)
        else:
            for i in range(2):
                c.start_engine(f"e{i}", *ENGINE, model=MODEL, env=own_gpu_first(i))
            for i in range(2):
                c.wait_engine(f"e{i}")
        yield c
    finally:
        c.close()


def test_through_the_client_outputs_equal_one_engines(reference, cluster):
    prompts, params = workload()

    async def run():
        client = await InferenceClient(cluster.address, timeout_s=60).start()
        outs = await asyncio.wait_for(asyncio.gather(*(client.add_request(p, sp) for p, sp in zip(prompts, params))),
                                      600)
        listing = await client.engines()
        stats = (await client.engine_stats())["engines"]
        client.close()
        return outs, listing, stats

    outs, listing, stats = asyncio.run(run())
    assert [e["submitted"] > 0 for e in listing["engines"]] == [True, True]  # both engines served
    assert sum(s["prefix_hit_tokens"] for s in stats.values()) > 0
    got = [(o.generated_tokens, o.generated_log_probs) for o in outs]
    same = sum(g == r for g, r in zip(got, reference))
    assert same == len(reference), f"{same} of {len(reference)} requests equal one engine's"


def test_through_the_openai_server_tokens_equal_one_engines(reference, cluster):
    prompts, params = workload()
    _, url = cluster.start_server("--default-model", "qwen3-0.6b")
    for i in range(0, len(prompts), 3):
        sp = params[i]
        body = {"prompt": prompts[i], "max_tokens": sp.num_tokens_to_generate, "ignore_eos": True,
                "return_token_ids": True, "temperature": sp.temperature if not sp.top_k else 0.0}
        if not sp.top_k:
            body.update(top_p=sp.top_p, seed=sp.seed)
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            choice = json.loads(r.read())["choices"][0]
        assert choice["token_ids"] == reference[i][0], f"request {i}"
