"""The step tables DynamicInferenceContext.initialize_attention_state writes (positions, block
tables, sampling flags, the host ring), CUDA-graph padding of decode, mixed and verify steps, the
forward batch's views of the snapshot, and a hybrid's Mamba row layout (its transitions:
test_dynamic_context.py)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_async.inference.contexts.kv_block_allocator import DUMMY_BLOCK  # noqa: E402
from megatron_async import InferenceConfig  # noqa: E402
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext  # noqa: E402
from megatron_async.inference.device import DeviceFacade  # noqa: E402
from megatron_async.inference.engines.request_book import RequestBook  # noqa: E402
from megatron_async.inference.step_plan import RowPlan, StepPlan  # noqa: E402
from megatron_async.models import build_default_model  # noqa: E402
from tests.helpers.context_harness import (  # noqa: E402
    BS, host, land, make_ctx, make_req, run_prefill,
)


@pytest.fixture(scope="module")
def model():
    return build_default_model("tiny", "cpu", torch.float32)


# ---------------------------------------------------------------- step tables
def test_initialize_attention_state_tables(model):
    ctx = make_ctx(model, num_kv_blocks=12)
    a = make_req(0, [10, 11, 12, 13, 14, 15])  # decode row, token known on the host
    b = make_req(1, [20, 21, 22])  # decode row whose input is an in-flight sample
    c = make_req(2, [30, 31, 32, 33, 34, 35, 36, 37, 38], temperature=0.7, top_k=5, top_p=0.9)  # chunk
    for r in (a, b, c):
        RequestBook(ctx).activate(r)
    run_prefill(ctx, a)
    land(a, 16)
    run_prefill(ctx, b)  # b now has one sample in flight at row 0
    assert b.num_inflight == 1 and b.inflight_row == 0
    ctx.reserve(c, 5)
    ctx.reserve(a, 1)
    ctx.reserve(b, 1)
    plan = StepPlan([
        RowPlan(a, 6, 1, samples=True),
        RowPlan(b, 3, 1, samples=True, prev_row=0),
        RowPlan(c, 0, 5, samples=False),
    ])
    shape = ctx.initialize_attention_state(plan)
    v = host(ctx)
    T, R = 7, 3
    assert (shape.num_tokens, shape.num_rows, shape.max_query_len, shape.max_kv_len) == (T, R, 5, 7)
    # a and b sample (temperature 1); c's top-k / top-p do not count: its row does not sample
    assert not shape.is_decode_only and shape.any_sampling and not shape.any_top_k_top_p
    assert v["input_ids"][:T].tolist() == [16, 0, 30, 31, 32, 33, 34]
    assert v["prev_sample_idx"][:T].tolist() == [-1, 0, -1, -1, -1, -1, -1]
    assert v["positions"][:T].tolist() == [6, 3, 0, 1, 2, 3, 4]
    slot = lambda req, p: req.block_ids[p // BS] * BS + p % BS  # noqa: E731
    assert v["slot_mapping"][:T].tolist() == [slot(a, 6), slot(b, 3)] + [slot(c, p) for p in range(5)]
    assert v["token_to_row"][:T].tolist() == [0, 1, 2, 2, 2, 2, 2]
    assert v["cu_query_lens"][: R + 1].tolist() == [0, 1, 2, 7]
    assert v["kv_lens"][:R].tolist() == [7, 4, 5]
    assert v["sample_token_idx"][:R].tolist() == [0, 1, 6]
    assert v["sample_position"][:R].tolist() == [7, 4, 5]
    assert v["seed"][:R].tolist() == [100, 101, 102]
    assert v["temperature"][:R].tolist() == pytest.approx([1.0, 1.0, 0.7])
    assert v["top_k"][:R].tolist() == [0, 0, 5]
    assert v["has_initial_state"][:R].tolist() == [True, True, False]
    width = ctx.max_blocks_per_request
    for r, req in enumerate((a, b, c)):
        nb = len(req.block_ids)
        assert v["block_table"][r, :nb].tolist() == req.block_ids
        assert v["block_table"][r, nb:].tolist() == [DUMMY_BLOCK] * (width - nb)
    # committed by the book: computed positions advanced; sampling rows now in flight at their row
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (6, 3, 0)  # assembly only writes
    RequestBook(ctx).commit(plan)
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (7, 4, 5)
    assert (a.num_inflight, a.inflight_row, b.num_inflight, b.inflight_row) == (1, 0, 2, 1)
    assert c.num_inflight == 0


def test_greedy_rows_get_canonical_params_and_flags(model):
    ctx = make_ctx(model)
    g = make_req(0, [1, 2], temperature=0.0, top_k=7, top_p=0.5)
    s = make_req(1, [3, 4], temperature=0.5, top_k=3, return_log_probs=True, top_n_logprobs=2)
    for r in (g, s):
        RequestBook(ctx).activate(r)
        ctx.reserve(r, 2)
    shape = ctx.initialize_attention_state(StepPlan([RowPlan(g, 0, 2, True), RowPlan(s, 0, 2, True)]))
    v = host(ctx)
    assert v["temperature"][:2].tolist() == pytest.approx([0.0, 0.5])
    assert v["top_k"][:2].tolist() == [1, 3] and v["top_p"][:2].tolist() == pytest.approx([0.0, 0.0])
    assert shape.any_sampling and shape.any_top_k_top_p and shape.any_log_probs and shape.max_top_n == 2


def test_ring_alternates_host_buffers(model):
    ctx = make_ctx(model)
    req = make_req(0, range(8))
    RequestBook(ctx).activate(req)
    run_prefill(ctx, req, 4)
    first = ctx._ring
    run_prefill(ctx, req, 4)
    assert ctx._ring != first
    assert host(ctx)["positions"][:4].tolist() == [4, 5, 6, 7]
    assert ctx._host_views[first]["positions"][:4].tolist() == [0, 1, 2, 3]  # previous step untouched


def test_pad_for_graph_decode_rows(model):
    ctx = make_ctx(model)
    reqs = [make_req(i, [i + 1]) for i in range(2)]
    for r in reqs:
        RequestBook(ctx).activate(r)
        ctx.reserve(r, 1)
    shape = ctx.initialize_attention_state(StepPlan([RowPlan(r, 0, 1, True) for r in reqs]))
    assert shape.is_decode_only
    before = {k: t.copy() for k, t in host(ctx).items()}
    ctx.pad_for_graph(2, 2, 4, 4)
    v = host(ctx)
    for k in before:  # live rows untouched
        n = 3 if k == "cu_query_lens" else 2
        assert (v[k][:n] == before[k][:n]).all(), k
    assert v["input_ids"][2:4].tolist() == [0, 0]
    assert v["prev_sample_idx"][2:4].tolist() == [-1, -1]
    assert v["slot_mapping"][2:4].tolist() == [DUMMY_BLOCK * BS] * 2
    assert v["token_to_row"][2:4].tolist() == [2, 3]
    assert v["cu_query_lens"][:5].tolist() == [0, 1, 2, 3, 4]
    assert v["kv_lens"][2:4].tolist() == [1, 1]
    assert v["sample_token_idx"][2:4].tolist() == [2, 3]
    assert v["temperature"][2:4].tolist() == [0.0, 0.0] and v["top_k"][2:4].tolist() == [1, 1]
    assert (v["block_table"][2:4] == DUMMY_BLOCK).all()
    assert not v["has_initial_state"][2:4].any()
    assert v["attention_row_order"][2:4].tolist() == [2, 3]  # the padded grid still visits each row once
    ctx.pad_for_graph(4, 4, 4, 4)  # nothing to pad
    assert v["cu_query_lens"][:5].tolist() == [0, 1, 2, 3, 4]


def test_pad_for_graph_mixed_step(model):
    """A mixed step of 2 rows / 7 tokens padded to 4 rows / 12 tokens: the first padding row
    takes one token, the last the other four; real rows untouched."""
    ctx = make_ctx(model)
    a, b = make_req(0, [5]), make_req(1, range(6))
    for r, n in ((a, 1), (b, 6)):
        RequestBook(ctx).activate(r)
        ctx.reserve(r, n)
    shape = ctx.initialize_attention_state(StepPlan([RowPlan(a, 0, 1, True), RowPlan(b, 0, 6, True)]))
    assert not shape.is_decode_only and (shape.num_tokens, shape.num_rows) == (7, 2)
    before = {k: t.copy() for k, t in host(ctx).items()}
    ctx.pad_for_graph(7, 2, 12, 4)
    v = host(ctx)
    for k in ("input_ids", "positions", "slot_mapping", "token_to_row"):
        assert (v[k][:7] == before[k][:7]).all(), k
    for k in ("kv_lens", "sample_token_idx", "temperature", "block_table"):
        assert (v[k][:2] == before[k][:2]).all(), k
    assert v["cu_query_lens"][:5].tolist() == [0, 1, 7, 8, 12]
    assert v["token_to_row"][7:12].tolist() == [2, 3, 3, 3, 3]
    assert v["slot_mapping"][7:12].tolist() == [DUMMY_BLOCK * BS] * 5
    assert v["positions"][7:12].tolist() == [0] * 5 and v["prev_sample_idx"][7:12].tolist() == [-1] * 5
    assert v["sample_token_idx"][2:4].tolist() == [7, 11] and v["kv_lens"][2:4].tolist() == [1, 1]
    assert v["attention_row_order"][:4].tolist() == [1, 0, 2, 3]  # the 6-token row first, then padding in order
    ctx.pad_for_graph(7, 2, 7, 4)  # rows only: the padding rows hold no token
    assert v["cu_query_lens"][:5].tolist() == [0, 1, 7, 7, 7]


def test_transfer_makes_forward_batch_views_of_the_snapshot(model):
    ctx = make_ctx(model)
    req = make_req(0, range(6))
    RequestBook(ctx).activate(req)
    ctx.reserve(req, 6)
    shape = ctx.initialize_attention_state(StepPlan([RowPlan(req, 0, 6, True)]))
    ctx.transfer_bookkeeping_to_gpu()
    batch = ctx.forward_batch(shape)
    assert batch.attn.positions.tolist() == list(range(6))
    assert batch.attn.block_table.tolist() == [host(ctx)["block_table"][0].tolist()]
    assert batch.attn.positions.data_ptr() == ctx.gpu_view.positions.data_ptr()
    assert batch.mamba is None and len(batch.kv_caches) == model.kv_cache_spec().num_layers


def test_uniform_verify_layout_and_its_graph_padding(model):
    """K = 2, verify width 3: a row with 2 drafts and a row with none, each 3 tokens and 3
    samples; the second row's two padding tokens take input 0, its last position, the dummy
    block and spec_src -2, their samples no sampling slot; then two padding rows of 3."""
    cfg = InferenceConfig(block_size_tokens=BS, num_kv_blocks=9, max_requests=4, max_tokens=32,
                          max_sequence_length=32, num_speculative_tokens=2)
    ctx = DynamicInferenceContext(cfg.cache_sizing(), model, DeviceFacade("cpu"), torch.float32)
    reqs = [make_req(i, [1, 2, 3], presence_penalty=0.5 * i) for i in range(2)]
    for r in reqs:
        RequestBook(ctx).activate(r)
        run_prefill(ctx, r)
        r.num_inflight, r.inflight_row = 0, -1
        r.generated_tokens.append(7 + r.request_id)
    for r, k in zip(reqs, (2, 0)):
        assert ctx.reserve(r, 1 + k)
    plan = StepPlan([RowPlan(r, 3, 1 + k, True, num_drafts=k) for r, k in zip(reqs, (2, 0))])
    shape = ctx.initialize_attention_state(plan, verify_width=3)
    assert (shape.num_tokens, shape.num_rows, shape.num_samples, shape.verify_width) == (6, 2, 6, 3)
    assert not shape.is_decode_only and shape.max_query_len == 3 and shape.num_drafts == [2, 0]
    assert shape.sample_base == [0, 3]
    v = host(ctx)
    b1 = reqs[1].block_ids[0]
    assert v["input_ids"][3:6].tolist() == [8, 0, 0] and v["spec_src"][:6].tolist() == [-1, 1, 2, -1, -2, -2]
    assert v["positions"][:6].tolist() == [3, 4, 5, 3, 3, 3]
    assert v["slot_mapping"][3:6].tolist() == [b1 * BS + 3, DUMMY_BLOCK * BS, DUMMY_BLOCK * BS]
    assert v["kv_lens"][:2].tolist() == [6, 4] and v["num_drafts"][:2].tolist() == [2, 0]
    assert v["sample_token_idx"][:6].tolist() == [0, 1, 2, 3, 4, 5]
    assert v["sample_to_row"][:6].tolist() == [0, 0, 0, 1, 1, 1]
    pad_slot = ctx.sampling_state.padding_slot
    assert v["sampling_slot"][3] == reqs[1].sampling_slot != pad_slot
    assert v["sampling_slot"][4:6].tolist() == [pad_slot] * 2 and v["top_k"][4:6].tolist() == [1, 1]
    RequestBook(ctx).commit(plan)
    assert reqs[0].num_computed_tokens == 6 and reqs[1].num_computed_tokens == 4  # real tokens only
    ctx.pad_for_graph(6, 2, 12, 4, verify_width=3)
    assert v["cu_query_lens"][:5].tolist() == [0, 3, 6, 9, 12]
    assert v["token_to_row"][6:12].tolist() == [2, 2, 2, 3, 3, 3]
    assert v["sample_base"][:4].tolist() == [0, 3, 6, 9] and v["sample_token_idx"][6:12].tolist() == list(range(6, 12))
    assert v["spec_slot"][2:4].tolist() == [ctx.spec.padding_slot] * 2 and v["kv_lens"][2:4].tolist() == [1, 1]
    assert v["slot_mapping"][6:12].tolist() == [DUMMY_BLOCK * BS] * 6 and v["sampling_slot"][6:12].tolist() == [pad_slot] * 6
    assert ctx.reserve(reqs[0], 4)
    reqs[0].generated_tokens += [9, 9, 9]  # as if its drafts had landed: position 6 is known
    with pytest.raises(Exception, match="uniform verify layout of 3 tokens per row cannot hold a row of 4"):
        ctx.initialize_attention_state(StepPlan([RowPlan(reqs[0], 6, 4, True, num_drafts=3)]), verify_width=3)
    assert reqs[0].num_computed_tokens == 6  # nothing committed


def test_hybrid_snapshot_carries_the_mamba_row_layout():
    """A hybrid context's snapshot: ``mamba_row_order`` (several-token rows first), state slots and
    fresh-or-continued flags per row; graph padding rows take the padding slot, start fresh and
    follow in order; the Mamba metadata are views of the snapshot with host sizes only."""
    from megatron_async.models.hybrid import build_hybrid
    from tests.helpers.hf_hybrid_models import make_tiny_hybrid_config

    hybrid = build_hybrid(make_tiny_hybrid_config("NemotronHForCausalLM").to_dict(), torch.float32, "cpu")
    ctx = make_ctx(hybrid, num_kv_blocks=16)
    a, b, c = make_req(0, [5]), make_req(1, range(6)), make_req(2, range(9))
    for r, n in ((a, 1), (b, 6), (c, 9)):
        RequestBook(ctx).activate(r)
        ctx.reserve(r, n)
    c.num_computed_tokens = 4  # c continues a state (a later prefill chunk)
    shape = ctx.initialize_attention_state(StepPlan([RowPlan(a, 0, 1, True), RowPlan(b, 0, 6, True),
                                                     RowPlan(c, 4, 5, True)]))
    v = host(ctx)
    assert v["mamba_row_order"][:3].tolist() == [1, 2, 0] and shape.num_multi_rows == 2
    assert v["state_slots"][:3].tolist() == [a.state_slot, b.state_slot, c.state_slot]
    assert v["has_initial_state"][:3].tolist() == [False, False, True]
    ctx.transfer_bookkeeping_to_gpu()
    meta = ctx.forward_batch(shape).mamba
    assert meta.num_scan_rows == 2 and meta.row_order.data_ptr() == ctx.gpu_view.mamba_row_order.data_ptr()
    assert meta.token_to_row.tolist() == [0] + [1] * 6 + [2] * 5
    ctx.pad_for_graph(12, 3, 16, 5)
    assert v["mamba_row_order"][:5].tolist() == [1, 2, 0, 3, 4]
    assert v["state_slots"][3:5].tolist() == [ctx.mamba.padding_slot] * 2 and not v["has_initial_state"][3:5].any()
