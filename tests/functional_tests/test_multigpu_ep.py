"""Data-parallel engines with expert parallelism on 2 / 4 GPUs (``pytest -m multigpu``;
skipped below the GPU count): the built-in tiny Qwen3-MoE in float32, experts split E ways, tokens
exchanged in every MoE layer; eager and CUDA graphs (greedy decode graphs captured by every rank
at once, padded to the agreed token count; a rank with nothing to launch replays the agreed graph
on padding rows, since NCCL needs captured-or-not to match across ranks), launch-ahead and
serial, one request alone (every other rank idle from the start), batches of greedy or sampled
requests and a batch mixing both: tokens equal EP=1's. The MoE exchange runs through the P2P
kernels (asserted: calls counted on every rank); test_multigpu_ep_layer.py covers the NCCL
collectives."""
from __future__ import annotations

import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.multiprocess import run_ranks

pytestmark = pytest.mark.multigpu

CONFIG = dict(block_size_tokens=16, num_kv_blocks=64, max_requests=8, max_tokens=64, max_sequence_length=128)
PROMPTS = [[3, 17, 42, 9, 100, 7], [25, 1, 2], [5] * 23, [60, 61, 62, 63, 64, 65, 66, 67, 68], [8, 9], [11] * 5]
GREEDY = [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True) for n in (6, 9, 4, 7, 5, 30)]
SAMPLED = [SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=8, ignore_eos=True, seed=1000 + i)
           for i in range(len(PROMPTS))]
LONE = ([3, 17, 42, 9, 100, 7], SamplingParams(top_k=1, num_tokens_to_generate=24, ignore_eos=True))
MIXED_PROMPTS = [[25, 1, 2], [5] * 23, [60, 61, 62, 63], [8, 9], [11] * 5]
MIXED = [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True) if i % 2 else
         SamplingParams(temperature=0.9, top_p=0.8, num_tokens_to_generate=n, ignore_eos=True, seed=100 + i)
         for i, n in enumerate((6, 9, 4, 7, 12))]
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run(llm: LLM) -> dict:
    outs = {}
    for mode in ("async", "serial"):
        llm.engine.async_scheduling = mode == "async"
        outs[f"{mode}_alone"] = llm.generate([LONE[0]], LONE[1])[0].generated_tokens
        for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
            outs[f"{mode}_{name}"] = [o.generated_tokens for o in llm.generate(PROMPTS, params)]
        outs[f"{mode}_mixed"] = [o.generated_tokens for o in llm.generate(MIXED_PROMPTS, MIXED)]
    return outs


def _worker(rank: int, world: int, graphs: bool) -> dict:
    cfg = InferenceConfig(**CONFIG, cuda_graphs=graphs)
    llm = LLM(None, device="cuda", inference_config=cfg, default_model="tiny-moe", expert_parallel_size=world)
    try:
        outs = run(llm)
        st = llm.engine.stats
        outs["served"], outs["dummy"] = st.finished_requests, st.dummy_steps
        graphs = llm.runner.graphs
        outs["replays"] = graphs.num_replays if graphs is not None else 0
        outs["padding_replays"] = graphs.num_padding_replays if graphs is not None else 0
        p2p = llm.parallel.ep_exchanger  # the default exchange on one host: CUDA P2P kernels, not NCCL
        outs["p2p_calls"] = dict(p2p.calls) if p2p is not None else {}
        return outs
    finally:
        llm.close()


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("ep", [2, pytest.param(4, marks=pytest.mark.gpus(4))])
def test_fp32_ep_tokens_equal_ep1(ep, graphs):
    expected = run(LLM(None, device="cuda", inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe"))
    ranks = run_ranks(_worker, ep, graphs, timeout_s=180, env=NCCL_ENV)
    assert sum(r.pop("served") for r in ranks) == 2 * (1 + 2 * len(PROMPTS) + len(MIXED_PROMPTS))  # each served once
    assert sum(r.pop("dummy") for r in ranks) > 0  # the long request kept one rank busy alone
    replays = [r.pop("replays") for r in ranks]
    padding_replays = sum(r.pop("padding_replays") for r in ranks)  # idle ranks replayed the agreed graph
    assert (min(replays) > 0 and padding_replays > 0) if graphs else max(replays) + padding_replays == 0
    for calls in (r.pop("p2p_calls") for r in ranks):
        assert calls.get("all_gather", 0) > 0 and calls.get("reduce_scatter", 0) > 0, calls
    for rank, got in enumerate(ranks):
        assert got == expected, f"rank {rank}"
