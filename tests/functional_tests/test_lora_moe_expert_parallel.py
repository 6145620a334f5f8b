"""LoRA adapters on MoE experts under expert parallelism (CPU, gloo, 2 spawned ranks of the
built-in tiny-moe, 4 of its 8 experts each): every rank loads the same adapters and keeps its
local experts' share; each request, whichever rank serves it, generates what the single engine
with that adapter merged into its weights generates. Both token exchanges: the all-gather (the
adapter slots gathered beside the tokens) and the all-to-all (the slots riding with the routing)."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_async import SamplingParams
from tests.helpers.lora_moe import expert_adapter, merge_into, tiny_moe
from tests.helpers.multiprocess import run_ranks

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8, lora_experts=True, max_requests=4)
PROMPTS = [[3, 17, 42, 9, 100, 7], [250, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68], [8, 9], [11, 12, 13]]
NAMES = ["x", None, "y", "x", "y", None]


def _params(name):
    return SamplingParams(top_k=1, num_tokens_to_generate=6, ignore_eos=True, lora=name)


def _adapters(llm) -> dict:
    return {"x": expert_adapter(llm, 8, 16, seed=0, include=lambda m: ".experts." in m or m.endswith("o_proj")),
            "y": expert_adapter(llm, 4, 8, seed=1, include=lambda m: ".experts." in m)}


def _worker(rank: int, world: int, exchange: str) -> dict:
    from megatron_async.config import ExpertExchange
    from megatron_async.models.layers.moe import RoutedExperts

    llm = tiny_moe(**LORA, expert_parallel_size=world)
    try:
        for m in llm.model.modules():
            if isinstance(m, RoutedExperts):
                m.parallel = dataclasses.replace(m.parallel, ep_exchange=ExpertExchange(exchange))
        for name, adapter in _adapters(llm).items():
            llm.load_lora(name, adapter)
        kept = llm.engine.context.lora.targets["model.layers.0.mlp.experts.0.gate_proj"].slots.num_local
        outs = llm.generate(PROMPTS, [_params(n) for n in NAMES])
        return {"tokens": [o.generated_tokens for o in outs], "served": llm.engine.stats.finished_requests,
                "kept": kept}
    finally:
        llm.close()


@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
def test_expert_adapters_under_expert_parallelism_equal_merged(exchange):
    probe = tiny_moe(**LORA)
    adapters = _adapters(probe)
    refs = {n: tiny_moe() if n is None else merge_into(tiny_moe(), adapters[n]) for n in (None, "x", "y")}
    expected = [refs[n].generate([p], _params(None))[0].generated_tokens for p, n in zip(PROMPTS, NAMES)]
    assert expected != [refs[None].generate([p], _params(None))[0].generated_tokens for p in PROMPTS]
    ranks = run_ranks(_worker, 2, exchange, timeout_s=240)
    assert ranks[0]["tokens"] == expected
    assert all(r["served"] > 0 for r in ranks) and all(r["kept"] == 4 for r in ranks)
