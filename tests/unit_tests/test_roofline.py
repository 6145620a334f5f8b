"""Floors the benchmarks divide by: the mixed-step FLOPs counted by hand from the config."""
from __future__ import annotations

import torch

from benchmarks.roofline import (decode_floor, expert_weight_bytes, measure_matmul_flops, prefill_flops,
                                            weight_bytes)
from megatron_async.models.default_model import DEFAULT_CONFIGS, build_default_model


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


def test_prefill_flops_count_each_token_through_its_top_k_experts():
    cfg = DEFAULT_CONFIGS["tiny-moe"]
    h, heads, kv, d, inter, layers = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                       "head_dim", "intermediate_size", "num_hidden_layers"))
    experts, k, moe_inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    attention = h * heads * d + 2 * h * kv * d + heads * d * h
    dense_layers = len(cfg["mlp_only_layers"])
    moe = h * experts + k * 3 * h * moe_inter  # router, then gate, up, down of k experts
    params = layers * attention + dense_layers * 3 * h * inter + (layers - dense_layers) * moe
    width = layers * heads * d
    assert prefill_flops(build_default_model("tiny-moe"), [4], 4) == 2 * params * 4 + 4 * width * 10
    assert measure_matmul_flops(torch.device("cpu"), torch.float32, n=64, iters=2) > 0


def test_moe_decode_floor_reads_the_routed_share_of_expert_weights():
    model = build_default_model("tiny-moe")
    experts = expert_weight_bytes(model)
    assert experts == sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n) > 0
    full = decode_floor(model, torch.float32, batch=1, mean_context=0.0, bandwidth=1.0)
    quarter = decode_floor(model, torch.float32, batch=1, mean_context=0.0, bandwidth=1.0, expert_share=0.25)
    assert full.weight_bytes == weight_bytes(model)
    assert full.weight_bytes - quarter.weight_bytes == 0.75 * experts


def test_mixed_floor_adds_the_bytes_no_fusion_avoids_to_the_flops():
    """A mixed step's floor: its FLOPs at the matmul rate plus every weight read once and its rows'
    KV read (prefix or context and new tokens) and written, at the copy bandwidth; means per step."""
    from benchmarks.roofline import kv_bytes_per_token, mixed_floor

    model = build_default_model("tiny")
    kv = kv_bytes_per_token(model, torch.float32)
    floor = mixed_floor(model, torch.float32, flops=6e12, steps=3, kv_read_tokens=900, kv_written_tokens=300,
                        matmul_rate=1e12, bandwidth=1e9)
    assert floor.flop_seconds == 2.0
    assert floor.byte_seconds == (3 * weight_bytes(model) + 1200 * kv) / 3 / 1e9
    assert floor.seconds == floor.flop_seconds + floor.byte_seconds


def test_fp8_flops_are_the_products_through_e4m3_weights():
    """An FP8 model's floor counts its e4m3 weights' products at the FP8 rate and the rest (the
    router, attention) at the 16-bit rate; block scales are no weights."""
    from benchmarks.roofline import mixed_floor

    cfg = DEFAULT_CONFIGS["tiny-moe"]
    h, heads, d, layers = (cfg[k] for k in ("hidden_size", "num_attention_heads", "head_dim", "num_hidden_layers"))
    moe_layers = layers - len(cfg["mlp_only_layers"])
    plain, fp8 = build_default_model("tiny-moe"), build_default_model("tiny-moe", quantization="fp8")
    total = prefill_flops(plain, [4], 4)
    assert prefill_flops(fp8, [4], 4) == total
    router, attention = 2 * moe_layers * h * cfg["num_experts"] * 4, 4 * layers * heads * d * 10
    assert prefill_flops(fp8, [4], 4, fp8_only=True) == total - router - attention
    assert prefill_flops(plain, [4], 4, fp8_only=True) == 0
    floor = mixed_floor(fp8, torch.float32, flops=6e12, steps=2, kv_read_tokens=0, kv_written_tokens=0,
                        matmul_rate=1e12, bandwidth=1e9, fp8_flops=4e12, fp8_rate=2e12)
    assert floor.flop_seconds == (2e12 / 1e12 + 4e12 / 2e12) / 2
