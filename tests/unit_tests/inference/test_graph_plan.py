"""The CUDA-graph plan (graph_plan.py) on the CPU: the keys warm-up captures are exactly the
keys serving can ask for, for every sampling combination and every step size, and a step's
key covers what it needs. Graphs themselves need CUDA; this checks the plan they come from."""
import itertools

import pytest
import torch

from megatron_async import InferenceConfig, SamplingParams
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.engines.request_book import RequestBook
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.inference.step_plan import RowPlan, StepPlan
from megatron_async.inference.text_generation_controllers.graph_plan import (
    GRAPH_TOP_N, GraphPlan, SamplingVariant, default_token_counts, sampling_needs, variant_flags, variant_of,
    variant_of_params,
)
from megatron_async.inference.text_generation_controllers.warmup import decode_row_counts, mixed_token_counts
from megatron_async.models import build_default_model
from megatron_async.step_shape import StepShape

CFG = dict(block_size_tokens=4, num_kv_blocks=400, max_requests=6, max_tokens=40, max_sequence_length=64)

# One entry per sampling feature a request can switch on (and greedy / plain temperature).
FEATURES = {
    "greedy": dict(top_k=1),
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=0.7, top_k=5),
    "top_p": dict(temperature=0.7, top_p=0.9),
    "min_p": dict(temperature=0.7, min_p=0.1),
    "presence": dict(temperature=0.7, presence_penalty=0.5),
    "repetition_greedy": dict(top_k=1, repetition_penalty=1.2),
    "min_tokens": dict(top_k=1, min_tokens=3),
    "log_probs": dict(top_k=1, return_log_probs=True),
    "top_n": dict(temperature=0.7, top_n_logprobs=GRAPH_TOP_N),
    "top_n_too_many": dict(top_k=1, top_n_logprobs=GRAPH_TOP_N + 1),
}


@pytest.fixture(scope="module")
def model():
    return build_default_model("tiny", "cpu", torch.float32)


def _covers(key, shape: StepShape, vocab: int) -> bool:
    f = variant_flags(key.variant, vocab, key.log_probs)
    return ((f.any_sampling or not shape.any_sampling) and all(a or not b for a, b in zip(f.filters, shape.filters))
            and (f.any_penalties or not shape.any_penalties) and (f.any_log_probs or not shape.any_log_probs)
            and f.max_top_n >= shape.max_top_n)


def _step_shape(model, features: tuple[str, str], prefill: bool) -> StepShape:
    """A real step of two requests with these features: both decoding, or one prefilling."""
    ctx = DynamicInferenceContext(InferenceConfig(**CFG).cache_sizing(), model, DeviceFacade("cpu"), torch.float32)
    rows = []
    for rid, name in enumerate(features):
        req = DynamicInferenceRequest(rid, list(range(1, 12)), SamplingParams(**FEATURES[name]), seed=rid,
                                      arrival_order=rid, eos_ids=(0,))
        RequestBook(ctx).activate(req)
        if not (prefill and rid == 1):  # a decode row: its prompt is computed already
            req.num_computed_tokens = 10
        n = 11 - req.num_computed_tokens
        assert ctx.reserve(req, n)
        rows.append(RowPlan(req, req.num_computed_tokens, n, True))
    return ctx.initialize_attention_state(StepPlan(rows))


@pytest.mark.parametrize("prefill", [False, True])
def test_every_sampling_combination_replays_a_planned_graph_that_covers_it(model, prefill):
    plan = GraphPlan(InferenceConfig(**CFG).graph_sizing(), model.vocab_size, mixed=True)
    planned = set(plan.keys())
    for pair in itertools.combinations_with_replacement(FEATURES, 2):
        shape = _step_shape(model, pair, prefill)
        assert shape.is_decode_only != prefill
        # data-parallel ranks agree on a variant before assembly, from the rows' params: the same answer
        assert variant_of_params(SamplingParams(**FEATURES[f]) for f in pair) == variant_of(shape), pair
        key = plan.key(shape)
        if "top_n_too_many" in pair:
            assert key is None  # more top log-probs than a graph computes: eager
            continue
        assert key in planned, pair
        assert _covers(key, shape, model.vocab_size), (pair, key)
        # the smallest graph that covers it: a decode step's log-probs replay its own variant's twin
        variant, log_probs = sampling_needs(shape)
        if prefill:  # no NUCLEUS graphs for mixed steps: FILTERED covers them
            want = SamplingVariant.FILTERED if variant_of(shape) == SamplingVariant.NUCLEUS else variant_of(shape)
            assert (key.variant, key.log_probs) == (want, False), (pair, key)
        else:
            assert (key.variant, key.log_probs) == (variant, log_probs and variant != SamplingVariant.FULL), (pair, key)
        assert key.num_tokens >= shape.num_tokens and key.num_rows > shape.num_rows - key.decode_only


def _shape(tokens, rows, variant, vocab, log_probs=False):
    f = variant_flags(variant, vocab, log_probs)
    return StepShape(tokens, rows, tokens - rows + 1, 1, tokens == rows, f.any_sampling, any(f.filters), f.max_top_n,
                     f.any_log_probs, any_penalties=f.any_penalties, filters=f.filters)


@pytest.mark.parametrize("max_requests,max_tokens", [(6, 40), (16, 300), (128, 8192)])
def test_keys_serving_can_request_equal_the_keys_warmup_captures(model, max_requests, max_tokens):
    cfg = InferenceConfig(**{**CFG, "max_requests": max_requests, "max_tokens": max_tokens})
    plan = GraphPlan(cfg.graph_sizing(), model.vocab_size, mixed=True)
    requested = set()
    for variant, lp in itertools.product(SamplingVariant, (False, True)):
        for rows in range(1, max_requests + 1):  # decode steps
            requested.add(plan.key(_shape(rows, rows, variant, model.vocab_size, lp)))
        step = max(1, max_tokens // 300)
        for tokens in range(2, max_tokens + 1, step):  # mixed steps (some row has 2+ tokens)
            most = min(tokens - 1, max_requests)
            for rows in {1, 2, most - 1, most} - {0, tokens}:
                key = plan.key(_shape(tokens, rows, variant, model.vocab_size, lp))
                assert not key.decode_only and key.num_tokens >= tokens and key.num_rows > rows
                requested.add(key)
        requested.add(plan.key(_shape(max_tokens, 1, variant, model.vocab_size, lp)))
    assert requested == set(plan.keys())
    assert len(plan.keys()) == len(set(plan.keys()))
    # decode graphs: the 5 variants and 4 log-prob twins per size; mixed graphs: 4 variants (no NUCLEUS)
    n_decode, n_mixed = len(plan.decode_sizes), len(plan.token_counts)
    assert len(plan.keys()) == 9 * n_decode + 4 * n_mixed
    if max_requests == 128:  # workload A's plan
        assert (n_decode, n_mixed, len(plan.keys())) == (12, 25, 208)
    untwinned = GraphPlan(cfg.graph_sizing(), model.vocab_size, mixed=True, log_prob_twins=False)
    assert len(untwinned.keys()) == 5 * n_decode + 4 * n_mixed and not any(k.log_probs for k in untwinned.keys())
    assert untwinned.key(_shape(3, 3, SamplingVariant.GREEDY, model.vocab_size, True)).variant == SamplingVariant.FULL


def test_top_p_and_min_p_decode_steps_skip_the_top_k_search(model):
    """A decode step whose rows filter by top-p or min-p alone replays NUCLEUS (its sampler runs no
    top-k stage); one row with top-k sends the step to FILTERED, as do its mixed steps."""
    plan = GraphPlan(InferenceConfig(**CFG).graph_sizing(), model.vocab_size, mixed=True)
    for pair, want in ((("top_p", "min_p"), SamplingVariant.NUCLEUS), (("top_p", "temperature"), SamplingVariant.NUCLEUS),
                       (("top_p", "top_k"), SamplingVariant.FILTERED)):
        assert plan.key(_step_shape(model, pair, False)).variant == want, pair
        assert plan.key(_step_shape(model, pair, True)).variant == SamplingVariant.FILTERED, pair
    assert variant_flags(SamplingVariant.NUCLEUS, model.vocab_size).filters == (False, True, True)
    assert variant_flags(SamplingVariant.FILTERED, model.vocab_size).filters == (True, True, True)


def test_plan_without_mixed_graphs_or_with_greedy_only(model):
    cfg = InferenceConfig(**CFG)
    decode_only = GraphPlan(cfg.graph_sizing(), model.vocab_size, mixed=False)
    assert all(k.decode_only for k in decode_only.keys())
    assert decode_only.key(_shape(7, 2, SamplingVariant.GREEDY, model.vocab_size)) is None
    greedy = GraphPlan(cfg.graph_sizing(), model.vocab_size, mixed=False, variants=(SamplingVariant.GREEDY,))
    assert greedy.key(_shape(3, 3, SamplingVariant.TEMPERATURE, model.vocab_size)) is None
    assert greedy.key(_shape(3, 3, SamplingVariant.GREEDY, model.vocab_size), min_rows=5).num_rows == 6
    assert {k.variant for k in greedy.keys()} == {SamplingVariant.GREEDY}


def test_default_token_counts_bound_the_padding():
    counts = default_token_counts(8192)
    assert counts == sorted(set(counts)) and counts[0] == 16 and counts[-1] == 8192
    assert all(c % 16 == 0 for c in counts)
    for t in range(257, 8193, 7):
        bucket = next(c for c in counts if c >= t)
        assert bucket <= 1.25 * t + 1  # at most a quarter of padding above 256 tokens
    assert default_token_counts(100)[-1] == 100 and max(default_token_counts(100)) == 100


def test_warmup_eager_sizes_cover_every_compile_class():
    rows = decode_row_counts(128, split_count=lambda r: max(1, 64 // r))
    classes = {(r == 1, r % 16 == 0, 1 << (r - 1).bit_length(), max(1, 64 // r)) for r in range(1, 129)}
    assert len(rows) == len(classes)
    tokens = mixed_token_counts(8192)
    assert tokens[0] == 2 and tokens[-1] == 8192
    for t in range(2, 8193):  # every (t % 16 == 0, next power of two) class of token counts is run
        assert any((u % 16 == 0) == (t % 16 == 0) and (u - 1).bit_length() == (t - 1).bit_length()
                   for u in tokens), t
