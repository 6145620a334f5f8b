"""Plain steps of a speculative engine, the host decisions alone (speculative/plain_steps.py,
the policy's freshness check, the graph keys): no GPU, requests as plain records."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from megatron_async import InferenceConfig, SamplingParams
from megatron_async.inference.engines.request_book import RequestBook
from megatron_async.inference.speculative.plain_steps import PlainStepSelector
from megatron_async.inference.speculative.policy import SpecPolicy
from megatron_async.inference.step_plan import RowPlan, StepPlan
from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner, decode_key
from megatron_async.inference.text_generation_controllers.graph_plan import GraphKey, SamplingVariant

GREEDY = SamplingParams(top_k=1)
CFG = InferenceConfig(max_requests=8, max_tokens=32, num_speculative_tokens=3, speculative_min_acceptance=0.3,
                      speculative_probe_interval=4, speculative_max_batch_size=4)


def req(acceptance: float = 0.0, fresh: bool = True, params: SamplingParams = GREEDY):
    return SimpleNamespace(sampling_params=params, prompt_tokens=[1], banned_sequences=(), spec_acceptance=acceptance,
                           spec_positions=0.0, spec_drafts_fresh=fresh, num_computed_tokens=5, num_inflight=0, inflight_row=-1,
                           num_inflight_drafts=0, generated_tokens=[7], max_generated_tokens=16)


BOOK = RequestBook(SimpleNamespace(max_sequence_length=CFG.max_sequence_length, spec=None, allocator=SimpleNamespace(enable_prefix_caching=False, publishes=False)))


def launched(sel: PlainStepSelector, p: StepPlan, speculative: bool) -> None:
    """What a launch does with the selector's decision: the selector records it, the request
    book marks the rows' drafts fresh or stale."""
    sel.launched(p, speculative, p.is_decode_only)
    BOOK.commit(p, speculative)


def plan(*rows: tuple, **kw) -> StepPlan:
    """rows: (request, drafts, prev_row)."""
    return StepPlan([RowPlan(r, start=5, num_tokens=1 + k, samples=True, prev_row=p, num_drafts=k) for r, k, p in rows],
                    **kw)


def at_step(policy: SpecPolicy, step: int) -> SpecPolicy:
    policy.step = step
    return policy


def test_which_steps_run_the_speculative_machinery():
    policy = SpecPolicy(CFG.speculation())
    sel = PlainStepSelector(policy)
    off, on = req(0.0), req(0.9)
    at_step(policy, 1)  # the next step (2) is no probe step
    assert sel.speculative(plan((off, 0, -1), (off, 0, -1))) is False  # nobody drafts now or next
    assert sel.speculative(plan((off, 0, -1), (on, 0, -1))) is True  # `on` drafts next
    assert sel.speculative(plan((off, 1, -1))) is True  # drafts now
    at_step(policy, 3)
    assert sel.speculative(plan((off, 0, -1))) is True  # step 4 probes: drafts come from this step
    at_step(policy, 1)
    pen = req(0.9, params=SamplingParams(top_k=1, presence_penalty=0.5))
    assert sel.speculative(plan((pen, 0, -1))) is False  # never drafts
    assert sel.speculative(plan(*[(on, 0, -1)] * 5)) is False  # over speculative_max_batch_size
    # prefill chunks: the same rule, over the rows that sample (a prompt's last chunk)
    assert sel.speculative(StepPlan([RowPlan(on, start=0, num_tokens=4, samples=True)])) is True  # drafts next
    assert sel.speculative(StepPlan([RowPlan(off, start=0, num_tokens=4, samples=True)])) is False
    assert sel.speculative(StepPlan([RowPlan(on, start=0, num_tokens=4, samples=False)])) is False  # prefills next
    drafts_beside_a_chunk = [RowPlan(off, start=5, num_tokens=2, samples=True, num_drafts=1), RowPlan(off, 0, 4, False)]
    assert sel.speculative(StepPlan(drafts_beside_a_chunk)) is True
    # rows continuing a launch in flight that verified drafts read the spec state
    launched(sel, plan((off, 1, -1), (on, 0, -1)), True)
    assert sel.inflight_verified and off.spec_drafts_fresh and on.spec_drafts_fresh
    p = plan((off, 0, 0))
    assert sel.speculative(p) is True and p.inflight_verified
    launched(sel, p, True)  # no drafts in it: its successors read its samples as plain rows do
    p = plan((off, 0, 0))
    assert sel.speculative(p) is False and not p.inflight_verified
    launched(sel, p, False)
    assert not off.spec_drafts_fresh and sel.plain_steps == 1 and sel.plain_mixed_steps == 0
    launched(sel, plan((off, 1, -1)), True)
    mixed = StepPlan([RowPlan(off, start=5, num_tokens=1, samples=True, prev_row=0), RowPlan(on, 0, 4, False)])
    assert sel.speculative(mixed) is True and mixed.inflight_verified  # continues a verify launch beside a chunk
    launched(sel, mixed, True)
    mixed = StepPlan([RowPlan(off, start=5, num_tokens=1, samples=True, prev_row=0), RowPlan(on, 0, 4, False)])
    assert sel.speculative(mixed) is False and not mixed.inflight_verified
    launched(sel, mixed, False)
    assert sel.plain_steps == 1 and sel.plain_mixed_steps == 1
    assert PlainStepSelector(None).speculative(plan((off, 0, -1))) is True  # no policy bound: always


def test_adaptive_steps_before_prefill_chunks_run_plain():
    """The adaptive rule drafts nothing in a step with prefill chunks: the step before it (the
    scheduler's ``chunks_next``) runs plain, its rows' next row has nothing to verify anyway."""
    policy = SpecPolicy(replace(CFG, speculative_adaptive=True, speculative_max_batch_size=0).speculation())
    sel, new = PlainStepSelector(policy), req(1.0)
    chunk = StepPlan([RowPlan(new, start=5, num_tokens=1, samples=True), RowPlan(req(1.0), 0, 4, True)])
    assert sel.speculative(chunk) is True  # rows without evidence: the rule probes next
    policy.chunks_next = True
    assert sel.speculative(chunk) is False and sel.speculative(plan((new, 0, -1))) is False


def test_a_request_without_fresh_drafts_does_not_draft():
    policy = at_step(SpecPolicy(CFG.speculation()), 4)  # a probe step
    assert policy.drafts_for(req(0.9), 2, room=10) == 3 and policy.drafts_for(req(0.0), 2, room=10) == 1
    assert policy.drafts_for(req(0.9, fresh=False), 2, room=10) == 0
    assert policy.drafts_for(req(0.0, fresh=False), 2, room=10) == 0
    assert policy.off_rows == {"stale": 2}
    at_step(policy, 5)
    assert policy.drafts_for(req(0.0, fresh=False), 2, room=10) == 0  # off by acceptance first
    assert policy.off_rows == {"stale": 2, "acceptance": 1}


def test_speculative_engines_capture_plain_decode_and_mixed_graphs_under_plain_keys():
    ctl = SimpleNamespace(model=SimpleNamespace(vocab_size=64))
    spec = CudaGraphRunner(ctl, CFG.graph_sizing(), mixed=True)
    plain = CudaGraphRunner(ctl, InferenceConfig(max_requests=8, max_tokens=32).graph_sizing(), mixed=True)
    # the plain engine's own forwards of its sampling tails (logits-only keys) aside: a speculative
    # engine's plain steps replay whole steps
    spec_keys, plain_keys = set(spec.plan.keys()), {k for k in plain.plan.keys() if not k.logits_only}
    assert plain.split_sampling and not spec.split_sampling
    assert any(k.decode_only for k in plain_keys) and any(not k.decode_only for k in plain_keys)
    assert plain_keys <= spec_keys  # a plain engine's decode and mixed keys, spec=False
    assert {replace_spec(k) for k in plain_keys} <= spec_keys  # and each with the machinery
    assert all(k.spec for k in spec_keys - plain_keys) and not any(k.spec for k in plain_keys)
    assert len(spec_keys) == 2 * len(plain_keys) + sum(bool(k.verify_width) for k in spec_keys)
    shape = SimpleNamespace(num_tokens=3, num_rows=3, is_decode_only=True, verify_width=0, num_samples=3,
                            max_top_n=0, any_penalties=False, any_log_probs=False, filters=(False,) * 3,
                            any_sampling=False, any_grammar=False)
    assert spec.plan.key(shape, spec=False) == plain.plan.key(shape) == decode_key(4)
    assert spec.plan.key(shape, spec=True) == spec.plan.key(shape) == decode_key(4, spec=True)
    mixed = SimpleNamespace(**{**shape.__dict__, "num_tokens": 20, "is_decode_only": False})  # a prefill chunk beside them
    assert spec.plan.key(mixed, spec=False) == plain.plan.key(mixed) == GraphKey(32, 9, False, SamplingVariant.GREEDY)
    assert spec.plan.key(mixed, spec=True) == spec.plan.key(mixed) == replace_spec(plain.plan.key(mixed))
    # data-parallel engines run the drafter in every step: decode graphs with the machinery only
    dp = CudaGraphRunner(ctl, CFG.graph_sizing(), mixed=True, collective=True)
    assert dp.plan.keys() == [decode_key(b, v, True) for b in (8, 4, 2, 1) for v in SamplingVariant]
    assert dp.plan.key(shape, spec=False) == decode_key(4, spec=True)


def replace_spec(key: GraphKey) -> GraphKey:
    return GraphKey(key.num_tokens, key.num_rows, key.decode_only, key.variant, key.verify_width, True)
