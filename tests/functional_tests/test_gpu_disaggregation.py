"""Prefill / decode disaggregation on GPUs: 1 prefill + 1 decode engine process (qwen3-0.6b shape,
bf16, batch-invariant), on one GPU each with NCCL transfers or CUDA IPC between the two GPUs
(``multigpu``: each engine sees both GPUs, its own first) or sharing one GPU with gloo transfers
through host memory or CUDA IPC (``gpu``): tokens and log-probs equal one engine's bit for bit, the
decode engine computes no prompt, both engines count the blocks they moved and the transfers' time.

    python -m pytest -q -m "gpu or multigpu" tests/functional_tests/test_gpu_disaggregation.py"""
from __future__ import annotations

import asyncio

import pytest

from megatron_async.client import InferenceClient
from tests.functional_tests.test_gpu_coordinator import ENGINE, MODEL, reference, workload  # noqa: F401 (fixture)
from benchmarks.commands.disagg import own_gpu_first
from tests.helpers.coordinator_procs import Cluster


def layouts():
    yield pytest.param("gloo", marks=pytest.mark.gpu, id="one-gpu-gloo")
    yield pytest.param("ipc", marks=pytest.mark.gpu, id="one-gpu-cuda-ipc")
    yield pytest.param("nccl", marks=pytest.mark.multigpu, id="two-gpus-nccl")
    yield pytest.param("ipc-split", marks=pytest.mark.multigpu, id="two-gpus-cuda-ipc")


@pytest.fixture(scope="module", params=list(layouts()))
def pair(request):
    c = Cluster("load_balanced", timeout_s=400)
    try:
        if request.param in ("gloo", "ipc"):  # each its share of one GPU
            c.add_engine("p", *ENGINE, "--role", "prefill", "--kv-transfer-backend", request.param,
                         "--gpu-memory-utilization", "0.4", model=MODEL)
            c.add_engine("d", *ENGINE, "--role", "decode", "--kv-transfer-backend", request.param,
                         "--gpu-memory-utilization", "0.8", model=MODEL)
        else:  # engine i on GPU i
            for i, role in enumerate(("prefill", "decode")):
                c.start_engine(role[0], *ENGINE, "--role", role, "--kv-transfer-backend", request.param.split("-")[0],
                               model=MODEL, env=own_gpu_first(i))
            for name in ("p", "d"):
                c.wait_engine(name)
        c.layout = request.param
        yield c
    finally:
        c.close()


def test_tokens_and_log_probs_equal_one_engines(reference, pair):  # noqa: F811
    prompts, params = workload()

    async def run():
        client = await InferenceClient(pair.address, timeout_s=60).start()
        outs = await asyncio.wait_for(asyncio.gather(*(client.add_request(p, sp) for p, sp in zip(prompts, params))),
                                      600)
        listing = (await client.engines())["engines"]
        stats = (await client.engine_stats())["engines"]
        client.close()
        return outs, listing, stats

    outs, listing, stats = asyncio.run(run())
    roles = {e["role"]: e for e in listing}
    assert roles["prefill"]["kv_sent_blocks"] > 0 and roles["decode"]["kv_received_blocks"] > 0
    assert stats[str(roles["decode"]["index"])]["prefill_steps"] == 0
    timed = stats[str(roles["decode" if pair.layout.startswith("ipc") else "prefill"]["index"])]
    assert timed["kv_transfers"] > 0 and timed["kv_transfer_bytes"] > 0 and timed["kv_transfer_seconds"] > 0
    got = [(o.generated_tokens, o.generated_log_probs) for o in outs]
    same = sum(g == r for g, r in zip(got, reference))
    assert same == len(reference), f"{same} of {len(reference)} requests equal one engine's ({pair.layout})"
