"""The plain engine's host fast paths in a speculative engine whose rows do not draft (as at
batch 128 and 0 % acceptance): decode steps without drafts take the numpy snapshot
(contexts/decode_rows.py) and launches without drafts land one sample per row (RequestBook.land). Outputs stay equal to plain decoding, token for token,
finish reasons and log-probs, greedy and seeded sampling, serial and launch-ahead, with the
oracle drafter at 0 % and at an intermediate acceptance; the counters show the fast paths ran.
And new requests start from the engine's recent acceptance: at 0 % a second batch pays no
wide verify rows."""
from collections import Counter

import pytest
import torch

from megatron_async import SamplingParams
from tests.helpers.engine_harness import Arrival, make_llm, random_prompts, run_arrivals
from tests.helpers.spec_harness import assert_partial_acceptance, assert_same_outputs, oracle_for

N = 40
PARAMS = [
    SamplingParams(top_k=1, num_tokens_to_generate=N, return_log_probs=True),
    SamplingParams(temperature=0.9, top_k=20, seed=5, num_tokens_to_generate=N, return_log_probs=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=6, num_tokens_to_generate=N - 7, ignore_eos=True,
                   return_log_probs=True),
]
CFG = dict(max_requests=6, max_tokens=32, speculative_probe_interval=6)


def _arrivals(seed: int, n: int = 6) -> list[Arrival]:
    return [Arrival(2 * i, p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(random_prompts(n, 3, 14, 256, seed))]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
@pytest.mark.parametrize("corrupt", [1.0, 0.4], ids=["0%", "60%"])
def test_spec_equals_plain_with_fast_paths(qwen3_ckpt, async_scheduling, corrupt):
    """0 %: requests switch off, most steps are plain steps. ~60 % acceptance against a 0.7
    threshold: requests switch off and on again (probes land), so verify rows with partial
    acceptance, drafter steps and plain steps all take turns."""
    arr = _arrivals(61)
    plain = run_arrivals(make_llm(qwen3_ckpt, async_scheduling=async_scheduling, **CFG), arr)
    knobs = dict(CFG, speculative_probe_interval=12) if corrupt == 1.0 else dict(CFG, speculative_min_acceptance=0.7)
    llm = make_llm(qwen3_ckpt, oracle_for(plain, arr, corrupt), num_speculative_tokens=3,
                   async_scheduling=async_scheduling, **knobs)
    spec = run_arrivals(llm, arr)
    assert_same_outputs(plain, spec, log_prob_tol=1e-5)
    st = llm.engine.stats
    assert st.spec_plain_steps > 0 and st.spec_off_rows["acceptance"] > 0, st.as_dict()
    # the fast paths ran: every plain step assembled by decode_rows, more launches landed without drafts
    assert st.fast_decode_snapshots >= st.spec_plain_steps > 0, st.as_dict()
    assert st.fast_landings > st.spec_plain_steps, st.as_dict()
    assert st.fast_landings < st.steps  # verify steps land with their drafts
    if corrupt == 1.0:
        assert st.spec_accepted_tokens == 0 and st.spec_plain_steps > 0.5 * st.decode_steps, st.as_dict()
    else:
        assert_partial_acceptance(st)
    assert llm.context.gpu_view.num_copies == st.steps


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_new_requests_start_from_recent_acceptance(qwen3_ckpt, async_scheduling):
    """The first batch at 0 % starts at acceptance 1.0 and pays k-draft verify rows before
    switching off; the engine's recent acceptance falls with them, so a second batch starts
    switched off: no 3-draft rows, only 1-draft probes, and the same tokens as plain decoding."""
    params = SamplingParams(top_k=1, num_tokens_to_generate=30, ignore_eos=True)
    first = [Arrival(0, p, params) for p in random_prompts(4, 3, 12, 256, seed=62)]
    second = [Arrival(0, p, params) for p in random_prompts(4, 3, 12, 256, seed=63)]
    cfg = dict(CFG, async_scheduling=async_scheduling)
    plain_llm = make_llm(qwen3_ckpt, **cfg)
    plain1, plain2 = run_arrivals(plain_llm, first), run_arrivals(plain_llm, second)
    oracle = oracle_for(plain1, first, 1.0)
    oracle.continuations.update({tuple(a.prompt): plain2[i].generated_tokens for i, a in enumerate(second)})
    llm = make_llm(qwen3_ckpt, oracle, num_speculative_tokens=3, **cfg)
    policy, st = llm.engine.scheduler.spec, llm.engine.stats
    assert policy.recent_acceptance == 1.0
    assert_same_outputs(plain1, run_arrivals(llm, first))
    wide_first = st.spec_draft_tokens_per_depth[2]
    assert wide_first >= 4 and policy.recent_acceptance < policy.min_acceptance, st.as_dict()
    verify_before = st.spec_verify_rows
    assert_same_outputs(plain2, run_arrivals(llm, second))
    assert st.spec_draft_tokens_per_depth[2] == wide_first, st.as_dict()  # no wide verify rows
    assert st.spec_verify_rows > verify_before, st.as_dict()  # probes still ran
    assert st.spec_accepted_tokens == 0


def _per_token(self, row, r: int, inflight: bool) -> None:
    """``_TokenColumns.add`` token by token for every row (the reference the slices must equal):
    the first token from the launch in flight (``prev_row``) or, after a launch that verified
    drafts, from the spec state (src 0); drafts from the spec state (src j); the rest known."""
    req, start, n, k, bs = row.request, row.start, row.num_tokens, row.num_drafts, self.bs
    for p in range(start, start + n):
        j = p - start
        from_spec = 0 < j <= k or j == 0 and inflight
        self.ids.append(0 if from_spec or j == 0 and row.prev_row >= 0 else req.token_at(p))
        self.prev.append(row.prev_row if j == 0 and row.prev_row >= 0 and not inflight else -1)
        if self.spec:
            self.src.append(j if from_spec else -1)
        self.pos.append(p)
        self.slots.append(req.block_ids[p // bs] * bs + p % bs)
        self.tok_row.append(r)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_spec_steps_lay_plain_rows_out_by_slices(qwen3_ckpt, async_scheduling, monkeypatch):
    """A speculative engine's prefill chunks and decode rows without drafts take the plain
    engine's slice path in the general snapshot (token by token, a 2,048-token prefill step took
    twice the plain engine's host time): every general snapshot of a run with prefill chunks
    beside decode rows, verify rows and rows continuing a verify launch equals the per-token
    layout, byte for byte (each assembled twice from the same state, over the same junk)."""
    from megatron_async.inference.contexts import general_rows

    arr = [Arrival(3 * i, p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(random_prompts(6, 9, 30, 256, seed=64))]
    cfg = dict(CFG, async_scheduling=async_scheduling)
    plain = run_arrivals(make_llm(qwen3_ckpt, **cfg), arr)
    llm = make_llm(qwen3_ckpt, oracle_for(plain, arr, 0.4), num_speculative_tokens=3, speculative_min_acceptance=0.0,
                   **cfg)
    ctx, seen = llm.context, Counter()
    general, slices = ctx._assemble_general, general_rows._TokenColumns.add

    def both(plan, verify_width):
        ring = ctx._ring
        out = []
        for add in (slices, _per_token):
            monkeypatch.setattr(general_rows._TokenColumns, "add", add)
            ctx._ring = ring
            ctx._host_buffers[ring ^ 1].fill_(0xA5)
            out.append((general(plan, verify_width), ctx._host_buffers[ring ^ 1].clone()))
        monkeypatch.setattr(general_rows._TokenColumns, "add", slices)
        assert out[0][0] == out[1][0] and torch.equal(out[0][1], out[1][1])
        for row in plan.rows:
            seen["chunk" if row.num_tokens > 1 + row.num_drafts else "drafts" if row.num_drafts else "plain"] += 1
            seen["inflight"] += row.prev_row >= 0 and plan.inflight_verified
        seen["mixed"] += not plan.is_decode_only and any(r.num_tokens == 1 + r.num_drafts for r in plan.rows)
        return out[0][0]

    ctx._assemble_general = both
    assert_same_outputs(plain, run_arrivals(llm, arr), log_prob_tol=1e-5)
    assert min(seen[k] for k in ("chunk", "drafts", "plain", "mixed")) > 0, seen
    assert seen["inflight"] > 0 or not async_scheduling, seen
