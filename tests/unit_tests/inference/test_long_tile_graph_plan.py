"""Long-tile twins in the CUDA-graph plan (``GraphKey.long_tiles``): only mixed graphs of at least
``long_tile_min`` tokens have one (never decode, verify or data-parallel graphs), a step replays the
twin exactly when the host chose the long-row launch, and the twin's capture shape carries it."""
import dataclasses

import pytest

from megatron_async import InferenceConfig
from megatron_async.inference.text_generation_controllers.cuda_graphs import graph_shape
from megatron_async.inference.text_generation_controllers.graph_plan import GraphPlan, SamplingVariant, variant_flags
from megatron_async.kernels.triton_prefill_common import LONG_TILE_MIN_QUERY
from megatron_async.step_shape import StepShape

VOCAB = 1000


def _config(**kw):
    return InferenceConfig(max_requests=128, max_tokens=8192, max_sequence_length=16384, **kw).graph_sizing()


def _shape(tokens, rows, max_query, long_tiles, variant=SamplingVariant.GREEDY):
    f = variant_flags(variant, VOCAB)
    return StepShape(tokens, rows, max_query, max_query, tokens == rows, f.any_sampling, any(f.filters), f.max_top_n,
                     f.any_log_probs, any_penalties=f.any_penalties, filters=f.filters, long_tiles=long_tiles)


@pytest.mark.parametrize("logits_only", [False, True])
def test_twins_only_for_buckets_that_hold_a_long_row(logits_only):
    base = GraphPlan(_config(), VOCAB, mixed=True, logits_only=logits_only)
    plan = GraphPlan(_config(), VOCAB, mixed=True, logits_only=logits_only, long_tile_min=LONG_TILE_MIN_QUERY)
    twins = [k for k in plan.keys() if k.long_tiles]
    large = [t for t in plan.token_counts if t >= LONG_TILE_MIN_QUERY]
    assert large and len(large) < len(plan.token_counts)  # some buckets below, some above
    mixed_variants = 4 + logits_only  # NUCLEUS is decode-only; logits-only graphs one more each
    assert len(twins) == len(large) * mixed_variants
    assert {k.num_tokens for k in twins} == set(large)
    assert all(not k.decode_only and not k.verify_width for k in twins)
    assert [k for k in plan.keys() if not k.long_tiles] == base.keys()  # the rest of the plan is unchanged
    assert all(k.label.endswith("+long") for k in twins)


def test_no_twins_for_data_parallel_engines_or_when_off():
    assert not any(k.long_tiles for k in GraphPlan(_config(), VOCAB, mixed=True).keys())
    collective = GraphPlan(_config(), VOCAB, mixed=True, collective=True, long_tile_min=LONG_TILE_MIN_QUERY)
    assert collective.long_tile_min == 0 and not any(k.long_tiles for k in collective.keys())


def test_step_replays_the_twin_exactly_when_the_host_chose_long_tiles():
    plan = GraphPlan(_config(), VOCAB, mixed=True, long_tile_min=LONG_TILE_MIN_QUERY)
    captured = set(plan.keys())
    for tokens, rows, max_query in [(2100, 3, 2048), (8192, 1, 8192), (3000, 40, 1000), (2047, 1, 2047), (64, 2, 63)]:
        for chosen in (False, True):
            if chosen and max_query < LONG_TILE_MIN_QUERY:
                continue  # the host never sets it there (test_long_tile_engine checks the host)
            key = plan.key(_shape(tokens, rows, max_query, chosen))
            assert key in captured and key.long_tiles == chosen and key.num_tokens >= tokens
    decode = plan.key(_shape(64, 64, 1, False))
    assert decode.decode_only and not decode.long_tiles
    twin = next(k for k in plan.keys() if k.long_tiles)
    assert graph_shape(twin, 16384, VOCAB).long_tiles
    assert not graph_shape(dataclasses.replace(twin, long_tiles=False), 16384, VOCAB).long_tiles
