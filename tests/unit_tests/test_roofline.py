"""Floors the benchmarks divide by: the mixed-step FLOPs counted by hand from the config."""
from __future__ import annotations

import torch

from megatron_async.models.default_model import DEFAULT_CONFIGS, build_default_model
from megatron_async.tools.roofline import measure_matmul_flops, prefill_flops


def test_prefill_flops_counts_every_linear_token_and_causal_pair():
    cfg = DEFAULT_CONFIGS["tiny"]
    h, heads, kv, d, inter, layers = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                       "head_dim", "intermediate_size", "num_hidden_layers"))
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter  # q, k, v, o, gate, up, down
    model = build_default_model("tiny")
    prompts = [3, 5]
    pairs = 3 * 4 / 2 + 5 * 6 / 2  # token i of a prompt attends to i + 1 positions
    width = layers * heads * d
    assert prefill_flops(model, prompts, 8) == 2 * layers * per_layer * 8 + 4 * width * pairs
    # half the prompt tokens prefilled (a run cut short): the pairs scale with them
    assert prefill_flops(model, prompts, 4) == 2 * layers * per_layer * 4 + 4 * width * pairs / 2


def test_prefill_flops_declines_moe_and_matmul_rate_is_positive():
    assert prefill_flops(build_default_model("tiny-moe"), [4], 4) is None
    assert measure_matmul_flops(torch.device("cpu"), torch.float32, n=64, iters=2) > 0

