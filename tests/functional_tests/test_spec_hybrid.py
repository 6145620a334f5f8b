"""Hybrid models (NemotronH, Bamba, Mamba2) under speculative decoding: output equals plain
decoding token for token (finish reasons and log-probs too), greedy and seeded sampling, serial
and launch-ahead, with staggered arrivals (prefill chunks beside verify windows), ragged draft
counts near length limits, memory pressure (pauses, evictions), EOS inside accepted runs and
prefix caching. The oracle drafter proposes the true continuation with ~30% of the tokens
corrupted, so acceptance is strictly between none and all; the Mamba step plans of every
forward are recorded to show which window layouts really ran."""
from __future__ import annotations

import pytest

from megatron_async import SamplingParams
from megatron_async.models.layers import mamba_step_plan
from tests.helpers.engine_harness import Arrival, forbid_host_traffic, make_llm, random_prompts, run_arrivals
from tests.helpers.hf_hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_checkpoint
from tests.helpers.spec_harness import assert_partial_acceptance, assert_same_outputs, oracle_for

K = 3


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def hybrid(request, tmp_path_factory):
    return make_tiny_hybrid_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture
def plan_kinds(monkeypatch):
    """Which Mamba paths each forward's plan used: 'uniform' (every row a window of one
    length), 'windows+prefill' (windows beside multi-token prefill rows), 'windows+single'
    (windows beside one-token rows), 'ragged' (windows of different lengths only)."""
    seen: set[str] = set()
    build = mamba_step_plan.MambaStepPlan.build.__func__

    def spy(cls, meta, triton=False):
        plan = build(cls, meta, triton)
        if plan.window_only:
            seen.add("uniform")
        elif plan.window is not None:
            others = meta.num_rows - meta.num_window_rows
            seen.add("windows+prefill" if meta.num_scan_rows else "windows+single" if others else "ragged")
        return plan

    monkeypatch.setattr(mamba_step_plan.MambaStepPlan, "build", classmethod(spy))
    return seen


def _llm(path, k: int, drafter=None, **cfg):
    return make_llm(path, drafter, **{"max_requests": 8, "max_sequence_length": 128, "num_speculative_tokens": k, **cfg})


def _oracle(llm_off, outs: dict, arrivals: list[Arrival], corrupt: float = 0.3):
    return oracle_for(outs, arrivals, corrupt, vocab=llm_off.model.vocab_size)


def _arrivals(vocab: int, seed: int, eos: int | None = None) -> list[Arrival]:
    prompts = random_prompts(8, 3, 22, vocab, seed=seed)
    out = []
    for i, p in enumerate(prompts):
        if i % 2:  # seeded top-k / top-p sampling with log-probs
            sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, num_tokens_to_generate=9 + 2 * i,
                                return_log_probs=True)
        else:
            sp = SamplingParams(top_k=1, num_tokens_to_generate=7 + 3 * i, termination_id=eos, ignore_eos=eos is None)
        out.append(Arrival(3 * i, p, sp))
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hybrid_spec_equals_plain(hybrid, async_scheduling, plan_kinds, monkeypatch):
    off_llm = _llm(hybrid, 0, async_scheduling=async_scheduling)
    arrivals = _arrivals(off_llm.model.vocab_size, seed=7)
    off = run_arrivals(off_llm, arrivals)
    assert not plan_kinds, "plain decoding ran a Mamba window"
    llm = _llm(hybrid, K, _oracle(off_llm, off, arrivals), async_scheduling=async_scheduling,
               speculative_min_acceptance=0.0)
    forbid_host_traffic(llm.model, monkeypatch)  # windows beside prefill rows too: all from the snapshot
    assert_same_outputs(off, run_arrivals(llm, arrivals), log_prob_tol=1e-5)
    st = llm.engine.stats
    assert_partial_acceptance(st)
    assert llm.context.gpu_view.num_copies == st.steps  # still one H2D copy per step
    assert {"uniform", "windows+prefill"} <= plan_kinds, plan_kinds
    if async_scheduling:
        assert st.overlapped_steps > 0.5 * st.steps, st.as_dict()


def test_hybrid_spec_under_pressure_with_eos_and_prefix_caching(hybrid, plan_kinds):
    """A small KV pool (pauses and evictions: evicted requests recompute their Mamba state), a
    frequent token as EOS so finishes land inside accepted runs, prefix caching of Mamba
    states on, acceptance-based switching left on (rows without drafts beside windows)."""
    cfg = dict(async_scheduling=True, num_kv_blocks=16, max_tokens=16, enable_prefix_caching=True,
               prefix_caching_mamba_gb=1e-3)
    plain_llm = _llm(hybrid, 0, **cfg)
    vocab = plain_llm.model.vocab_size
    shared = random_prompts(1, 9, 9, vocab, seed=10)[0]
    plain = run_arrivals(plain_llm, [Arrival(a.step, shared + a.prompt, a.params) for a in _arrivals(vocab, seed=11)])
    # EOS: the token the greedy rows emit most (past their first) without one. Until the first
    # stop the run with it computes what this run did, so some request stops, whatever the
    # model's weights (they move with the library versions that build it).
    seen = [t for i, o in plain.items() if i % 2 == 0 for t in o.generated_tokens[1:]]
    eos = max(sorted(set(seen)), key=seen.count)
    arrivals = [Arrival(a.step, shared + a.prompt, a.params) for a in _arrivals(vocab, seed=11, eos=eos)]
    off_llm = _llm(hybrid, 0, **cfg)
    off = run_arrivals(off_llm, arrivals)
    llm = _llm(hybrid, K, _oracle(off_llm, off, arrivals, corrupt=0.5), **cfg)
    assert_same_outputs(off, run_arrivals(llm, arrivals), log_prob_tol=1e-5)
    st = llm.engine.stats
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens, st.as_dict()
    assert st.paused > 0 and st.evicted > 0 and st.prefix_hit_tokens > 0, st.as_dict()
    assert any(o.finish_reason == "stop" for o in off.values())
    assert "uniform" in plan_kinds and len(plan_kinds) >= 2, plan_kinds


def _first_draft(seq: list[int], max_ngram: int) -> int:
    """The n-gram drafter's first proposal after ``seq`` (ngram.py's rule, on the host): the token
    after the latest earlier occurrence of the longest suffix of up to ``max_ngram`` tokens that
    occurred before; without one, the last token again."""
    last, best = len(seq) - 1, -1
    for n in range(1, min(max_ngram, last + 1) + 1):
        suffix = seq[last - n + 1:]
        best = next((e for e in range(last - 1, n - 2, -1) if seq[e - n + 1:e + 1] == suffix), best)
    return seq[best + 1] if best >= 0 else seq[last]


def _predictable(prompt: list[int], out: list[int], max_ngram: int) -> int:
    """Output positions past the first (prefill samples it) whose first draft would be right."""
    return sum(_first_draft(prompt + out[:t], max_ngram) == out[t] for t in range(1, len(out)))


def test_hybrid_ngram_drafts(hybrid):
    """Prompt lookup on repetitive prompts: output equals plain decoding. Of 12 candidate
    prompts, the 4 whose plain outputs the drafter's rule predicts best run, so drafts are
    accepted whatever the random model's weights (they move with the library versions that
    build it; tiny random models rarely fall into loops of their own)."""
    off_llm = _llm(hybrid, 0, max_requests=12)
    vocab = off_llm.model.vocab_size
    candidates = [(p * 6)[:24] for p in random_prompts(12, 2, 4, vocab, seed=12)]
    sp = SamplingParams(top_k=1, num_tokens_to_generate=24, ignore_eos=True)
    max_ngram = off_llm.config.speculative_ngram_max
    counts = [_predictable(p, o.generated_tokens, max_ngram) for p, o in zip(candidates, off_llm.generate(candidates, sp))]
    chosen = sorted(range(len(candidates)), key=lambda i: -counts[i])[:4]
    assert sum(counts[i] for i in chosen) > 0, f"no plain output the n-gram rule predicts: {counts}"
    prompts = [candidates[i] for i in chosen]
    off = off_llm.generate(prompts, sp)
    llm = _llm(hybrid, K, speculative_method="ngram", speculative_min_acceptance=0.0)
    on = llm.generate(prompts, sp)
    assert [o.generated_tokens for o in on] == [o.generated_tokens for o in off]
    st = llm.engine.stats
    assert 0 < st.spec_accepted_tokens <= st.spec_draft_tokens, st.as_dict()
