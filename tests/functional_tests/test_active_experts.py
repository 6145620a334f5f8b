"""The share of routed experts a decode step reads (the MoE decode floor's numerator), measured
through routing replay on the built-in tiny MoE (8 experts, top 2)."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.active_experts import decode_expert_share, moe_expert_counts
from megatron_async import LLM, InferenceConfig
from megatron_async.models.default_model import DEFAULT_CONFIGS


@pytest.fixture(scope="module")
def moe_llm():
    return LLM(None, inference_config=InferenceConfig(num_kv_blocks=64, max_requests=8), default_model="tiny-moe")


def test_one_row_reads_top_k_experts_and_more_rows_read_their_union(moe_llm):
    cfg = DEFAULT_CONFIGS["tiny-moe"]
    counts = moe_expert_counts(moe_llm.model)
    assert counts == [cfg["num_experts"]] * (cfg["num_hidden_layers"] - len(cfg["mlp_only_layers"]))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg["vocab_size"], size=int(n)).tolist() for n in rng.integers(3, 12, size=8)]
    k_over_e = cfg["num_experts_per_tok"] / cfg["num_experts"]
    shares = [decode_expert_share(moe_llm, prompts, b) for b in (1, 2, 4, 8)]
    assert shares[0] == pytest.approx(k_over_e)  # one token: its k distinct experts in every layer
    assert all(a <= b for a, b in zip(shares, shares[1:])) and shares[-1] <= 1.0  # unions of growing batches
    assert shares[-1] > k_over_e  # 8 random tokens do not all pick the same 2 of 8 experts in every layer


def test_dense_model_has_no_expert_share():
    llm = LLM(None, inference_config=InferenceConfig(num_kv_blocks=16, max_requests=2))
    assert decode_expert_share(llm, [[1, 2, 3]], 1) is None
    assert llm.engine.stats.finished_requests == 0  # nothing was run to find out
